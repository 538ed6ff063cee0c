"""The dry run's log without DeepSpeed's memory reports: BF16_Optimizer forces see_memory_usage at
every build ("MA ... GB", "CPU Virtual Memory: ..." six times per rank), which in a dry run reads
the fake device's meter and this host's RAM."""
import importlib.util
import sys

from conftest import ROOT


def test_the_dry_run_makes_deepspeeds_memory_reports_quiet(capsys, monkeypatch):
    import deepspeed.runtime.bf16_optimizer as bf16
    import deepspeed.runtime.utils as ds_utils
    for name, module in list(sys.modules.items()):  # put back whatever the tool replaces
        if name.startswith("deepspeed") and hasattr(module, "see_memory_usage"):
            monkeypatch.setattr(module, "see_memory_usage", module.see_memory_usage)
    bf16.see_memory_usage("begin bf16_optimizer", force=True)
    assert "CPU Virtual Memory" in capsys.readouterr().out  # what the dry run's log carried
    spec = importlib.util.spec_from_file_location("dry_run_tool", ROOT / "tools" / "dry_run.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.quiet_deepspeed_memory_reports()
    bf16.see_memory_usage("begin bf16_optimizer", force=True)  # imported by name before
    ds_utils.see_memory_usage("later", force=True)  # what a module imported afterwards gets
    assert capsys.readouterr().out == ""
