"""One process, no torch.distributed: reshard a checkpoint to another layout, export the consolidated
weights, and write a checkpoint of any layout from full tensors."""
