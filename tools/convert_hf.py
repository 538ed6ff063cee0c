#!/usr/bin/env python
"""Convert weights between Hugging Face checkpoint directories and moe_trainer.

  python tools/convert_hf.py import HF_DIR OUT.safetensors [--config-out OUT.yaml]
  python tools/convert_hf.py export --config configs/X.yaml --weights W.safetensors OUT_DIR [--set k=v ...]

import: a DeepSeek-V3 (DeepseekV3ForCausalLM, FP8 or not) or Llama (LlamaForCausalLM)
  directory (config.json + *.safetensors, sharded or not) -> one safetensors file keyed
  by our parameter names, plus a YAML file with the matching `model:` section.
export: our weights (a safetensors file of our names, or a run checkpoint directory
  such as runs/X/checkpoints/step_N/) and the run's config -> a directory that
  transformers.AutoModelForCausalLM.from_pretrained loads. Without --config, the
  config.yaml of the run directory holding the checkpoint is used. The tokenizer
  (tokenizer.json, tokenizer_config.json: the run directory's, else the data's)
  goes with it, its special-token ids in config.json and generation_config.json,
  so AutoTokenizer.from_pretrained(OUT_DIR) and generate work on the export.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_trainer import hf  # noqa: E402
from moe_trainer.config import ConfigError  # noqa: E402
from moe_trainer.resolve import load_config  # noqa: E402
from moe_trainer.export import export_weights  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cmd_import(args) -> str:
    model = hf.from_hf(args.hf_dir)
    out = Path(args.out)
    config_out = Path(args.config_out) if args.config_out else out.with_suffix(".yaml")
    hf.save_weights_file(model, out)
    hf.save_model_yaml(model.cfg, config_out)
    n = sum(p.numel() for p in model.parameters())
    return f"wrote {out} ({n:,} parameters, {model.cfg.arch}) and its model config {config_out}"


def find_run_config(weights: Path) -> Path:
    """runs/X/checkpoints/step_N[/part-r00000.safetensors] -> runs/X/config.yaml."""
    for parent in list(weights.resolve().parents)[:4]:
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    raise hf.HFFormatError(f"no --config given and no config.yaml found above {weights}; pass --config.")


def cmd_export(args) -> str:
    weights = Path(args.weights)
    config = args.config or str(find_run_config(weights))
    cfg = load_config(config, args.set)
    # streamed: one output shard in memory at a time, never the whole model
    out = export_weights(cfg.model, weights, args.out_dir, dtype=DTYPES[args.dtype],
                         stacked_experts=args.stacked_experts, max_shard_bytes=int(args.max_shard_gb * 1e9),
                         overwrite=args.overwrite)
    with tempfile.TemporaryDirectory() as scratch:
        source = tokenizer_dir(args, cfg, Path(config).parent, Path(scratch))
        try:
            if source is None:
                raise hf.HFFormatError("neither the run directory nor the data of the config holds this model's "
                                       "tokenizer")
            ids = hf.export_tokenizer(out, source)
        except hf.HFFormatError as e:
            if args.tokenizer:
                raise
            print(f"warning: {e}; the export has no tokenizer (--tokenizer DIR gives one)", file=sys.stderr)
            return f"wrote {out} (config.json + safetensors, {args.dtype}) for transformers' AutoModelForCausalLM"
    return (f"wrote {out} (config.json + safetensors, {args.dtype}; tokenizer with {ids}) for transformers' "
            f"AutoModelForCausalLM and AutoTokenizer")


def tokenizer_dir(args, cfg, config_dir: Path, scratch: Path):
    """Where the export's tokenizer comes from: --tokenizer, else the run directory's files, else
    those of the config's data if the model's vocabulary is the data's (the default corpus's byte
    tokenizer written into `scratch`); None if there is none."""
    from moe_trainer.data import DataError, byte_tokenizer_files, data_vocab_size
    if args.tokenizer:
        return Path(args.tokenizer)
    if (config_dir / "tokenizer.json").is_file():
        return config_dir
    try:
        if data_vocab_size(cfg.data.path) != cfg.model.vocab_size:
            return None  # e.g. an imported model: its config's data is not what it was trained on
    except DataError:
        return None
    if cfg.data.path:
        return Path(cfg.data.path) if (Path(cfg.data.path) / "tokenizer.json").is_file() else None
    for name, text in byte_tokenizer_files().items():
        (scratch / name).write_text(text)
    return scratch


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> our safetensors + model YAML")
    imp.add_argument("hf_dir", help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    imp.add_argument("out", help="safetensors file to write, keyed by our parameter names")
    imp.add_argument("--config-out", help="YAML file for the model section (default: OUT with .yaml)")
    imp.set_defaults(run=cmd_import)
    exp = sub.add_parser("export", help="our weights + config -> Hugging Face directory")
    exp.add_argument("out_dir", help="directory to write (must not exist or be empty, unless --overwrite)")
    exp.add_argument("--weights", required=True,
                     help="safetensors file of our names, or a run checkpoint directory (checkpoints/step_N)")
    exp.add_argument("--config", help="run config YAML (default: config.yaml of the run holding --weights)")
    exp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype to write")
    exp.add_argument("--stacked-experts", action="store_true",
                     help="write experts stacked (gate_up_proj / down_proj) instead of one tensor per expert")
    exp.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    exp.add_argument("--tokenizer", help="directory with tokenizer.json + tokenizer_config.json (default: the run "
                                         "directory's, else its data's)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0,
                     help="largest output shard in GB (memory is bounded by one shard; default: %(default)s)")
    exp.set_defaults(run=cmd_export)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        print(args.run(args))
    except (hf.HFFormatError, ConfigError, OSError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
