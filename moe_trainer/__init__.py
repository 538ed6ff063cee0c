"""moe_trainer: DeepSeek-V3-style MoE (EP + PP + ZeRO-1) and Llama-3 dense (TP/SP, CP, PP, DP) training on DeepSpeed."""
__version__ = "0.1.0"
