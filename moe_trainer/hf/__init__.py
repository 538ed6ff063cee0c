"""Hugging Face interop: DeepSeek-V3 and Llama checkpoint directories <-> our models.

A Hugging Face checkpoint directory is `config.json` plus `*.safetensors`
(one `model.safetensors`, or shards listed in `model.safetensors.index.json`).
Only safetensors are read; pickled `.bin` files never are.

Names: ours are Hugging Face's minus the `model.` prefix, except
- MoE experts: transformers keeps them stacked in memory
  (`mlp.experts.gate_up_proj` (E, 2H, d), `mlp.experts.down_proj` (E, d, H)), as
  we do, but `save_pretrained` and DeepSeek's release write one tensor per expert
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`). Both layouts load; `to_hf`
  writes the per-expert one (what transformers itself writes) unless asked.
- multi-token prediction: our `mtp.{k}.{enorm,hnorm,eh_proj,block.*,norm}` is
  DeepSeek's `model.layers.{L + k}.{enorm,hnorm,eh_proj,*,shared_head.norm}`;
  DeepSeek also stores copies of the embedding and output head there
  (`embed_tokens`, `shared_head.head`), which we write and skip on reading.
  transformers' DeepseekV3ForCausalLM ignores these keys.
- FP8 checkpoints (DeepSeek's release: `quantization_config.quant_method: fp8`,
  `weight_scale_inv` per 128x128 block) are dequantized on load.

Every failure is an `HFFormatError` (a ValueError) with one sentence naming the
field, key or file at fault.

Modules (each public name is re-exported here: `from moe_trainer.hf import ...` is the import path):
- errors.py: HFFormatError, PathLike;
- config_json.py: config.json <-> ModelConfig (hf_config_to_model_config, model_config_to_hf, read_config);
- names.py: Hugging Face parameter names <-> ours (hf_to_our_name, our_to_hf_name);
- read.py: a Hugging Face directory -> our model (from_hf, convert_hf_state_dict, load_checked,
  check_keys_and_shapes: every weights source's key-and-shape check);
- write.py: our model -> a Hugging Face directory (to_hf, hf_state_dict);
- tokenizer.py: the tokenizer of an export (export_tokenizer, special_token_ids, tokenizer_size);
- weights_file.py: our own weight files and model YAML, the model of a Hugging Face train.init_from
  (init_from_model, check_same_model, hf_dir_model, save_weights_file, model_yaml, save_model_yaml);
  init_from.py loads train.init_from's weights (load_initial_weights).
"""
# re-exported: every public name the single module hf.py held, at its old import path
from .config_json import (ARCHITECTURES, COMMON_FIELDS, DEEPSEEK_FIELDS, DEFAULT_ROPE_THETA, EXTRA_KEY,  # noqa: F401
                          HF_CLASS, HF_DEFAULTS, LLAMA_FIELDS, MODEL_TYPES, ROPE_KEYS, TRAINING_FIELDS,
                          hf_config_to_model_config, model_config_to_hf, read_config)
from .errors import HFFormatError, PathLike  # noqa: F401
from .names import hf_to_our_name, our_to_hf_name  # noqa: F401
from .read import check_keys_and_shapes, convert_hf_state_dict, from_hf, load_checked, read_safetensors  # noqa: F401
from .tokenizer import export_tokenizer, special_token_ids, tokenizer_size  # noqa: F401
from .weights_file import (check_same_model, hf_dir_model, init_from_model, model_yaml, save_model_yaml,  # noqa: F401
                           save_weights_file)
from .write import DEFAULT_SHARD_BYTES, KEEP_FP32, hf_state_dict, to_hf  # noqa: F401

# init_from.py reads a Hugging Face directory block by block with these
from .names import _EXPERT_KEY, _IGNORED  # noqa: F401
from .read import _checkpoint_files, _listing  # noqa: F401

__all__ = ["HFFormatError", "from_hf", "to_hf", "hf_config_to_model_config", "model_config_to_hf",
           "init_from_model", "hf_state_dict", "convert_hf_state_dict", "save_weights_file", "model_yaml",
           "save_model_yaml", "export_tokenizer", "special_token_ids", "tokenizer_size"]
