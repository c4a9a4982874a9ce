"""Expert parallel over several GPUs or nodes (`--gpus N`, torchrun): torch.distributed process
groups (group.py), each rank's share of the experts and their combine (experts.py), rank 0's
step inputs followed by the other ranks (step.py), and how a verb starts its ranks (launch.py).
docs/multi-gpu.md says how to run it."""
