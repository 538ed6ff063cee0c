"""Every tensor on its device: the product's per-step code makes no tensor without `device=`.

A tensor factory (torch.zeros, torch.arange, torch.tensor, ...) without a device makes a CPU
tensor; on a GPU that is a crash when it meets a CUDA tensor, or a host-to-device copy (and often a
sync) when something moves it. The AST of every module that runs each step is walked for such
calls; what is left is a short list of functions that run once at build time or are host-side by
design, each with its reason. Module constructors (`__init__`) build parameters and buffers that
move with the module, and are not per-step."""
from __future__ import annotations

import ast

from conftest import ROOT

PACKAGE = ROOT / "moe_trainer"
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "randn", "rand", "randint", "eye",
             "linspace", "randperm", "zeros_like", "ones_like", "empty_like", "full_like"} - {
    "zeros_like", "ones_like", "empty_like", "full_like"}  # *_like take their input's device
PER_STEP = [*sorted((PACKAGE / "models").glob("*.py")), PACKAGE / "rope.py", *sorted((PACKAGE / "moe").glob("*.py")),
            PACKAGE / "moe" / "placement" / "runtime.py",  # the placement solvers beside it are host-side planning
            *sorted((PACKAGE / "parallel").glob("*.py")), PACKAGE / "kernels" / "accelerator.py",
            PACKAGE / "kernels" / "reference.py", PACKAGE / "trainer.py",
            PACKAGE / "guards.py", PACKAGE / "observers.py",  # the trainer's components, split out of it
            PACKAGE / "expert_load" / "tracker.py"]  # the trainer's per-step expert-load bookkeeping
ALLOWED = {
    # (file, function): why it may make host tensors
    ("rope.py", "rope_inv_freq"): "the RoPE frequency table, built once into a buffer that moves with the model",
    ("models/init.py", "*"): "initial values, made once at build time on the host and materialised into the module",
    ("models/lm.py", "init_weights"): "initial values, once at build time",
    ("moe/placement/runtime.py", "replica_candidates"): "a placement's candidate table, built once per plan; "
                                                        "LayerPlacement.on copies it to the device once",
    ("parallel/replicas.py", "_fetch_plan"): "a placement's index tensors, built once; LayerPlacement.on copies them to "
                                             "the device once",
    ("parallel/replicas.py", "layer_placement"): "the same, built once at start-up",
    ("parallel/slots.py", "owned_placement"): "a slot-owned placement's tables, built once per re-placement; "
                                              "LayerPlacement.on copies them to the device once",
    ("parallel/slots.py", "_cache_tables"): "the redundant slots' refresh tables, built with the placement's "
                                            "(host tables, copied to the device once by LayerPlacement.on)",
    ("parallel/slots.py", "_reset"): "the re-placement's load sums, host-side by design (update_bias copies the "
                                     "counts there), reset once per decision",
    ("moe/balance.py", "skewed_biases"): "debug.route_skew's initial biases, made once at build time and copied "
                                         "into the gate's buffer",
}


def factory_calls_without_device(path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name == "__init__":
            continue
        for call in ast.walk(fn):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
                    and call.func.attr in FACTORIES and not any(k.arg == "device" for k in call.keywords)):
                yield fn.name, call.lineno, call.func.attr


def test_per_step_code_makes_every_tensor_on_a_device():
    found = []
    for path in PER_STEP:
        rel = str(path.relative_to(PACKAGE))
        for fn, line, name in factory_calls_without_device(path):
            if (rel, fn) not in ALLOWED and (rel, "*") not in ALLOWED:
                found.append(f"{rel}:{line} {fn}: torch.{name} without device=")
    assert found == [], "\n".join(found)


def test_the_audit_finds_a_factory_without_device(tmp_path):
    """The walk sees what it must (and skips constructors)."""
    src = tmp_path / "m.py"
    src.write_text("import torch\n\nclass A:\n    def __init__(self):\n        self.b = torch.zeros(3)\n\n"
                   "def step(x):\n    return x + torch.ones(3)\n\ndef fine(x):\n"
                   "    return torch.arange(3, device=x.device)\n")
    assert list(factory_calls_without_device(src)) == [("step", 8, "ones")]


def test_allow_list_entries_still_exist():
    for (rel, fn) in ALLOWED:
        text = (PACKAGE / rel).read_text()
        assert fn == "*" or f"def {fn}(" in text, (rel, fn)
