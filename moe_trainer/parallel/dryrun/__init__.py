"""The dry run (tools/dry_run.py): any layout at any world size in one process, on fake CUDA tensors
(fake_cuda.py, cuda_guard.py) under NCCL's rules (nccl_rules.py), one simulated rank at a time
through the real trainer (runner.py). Importing runner shims torch.cuda for the whole process."""
