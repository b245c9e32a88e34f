"""What `hfsdp train` checks on this machine before any rank starts: paths, the checkpoint to resume, the model
on meta, the GPUs (`preflight`), and whether the run fits (`memory_check`, with the planner's inputs from
`plan_inputs`).

May import `settings` (and `rank.tensorboard_log`, to ask whether TensorBoard is installed).
"""
