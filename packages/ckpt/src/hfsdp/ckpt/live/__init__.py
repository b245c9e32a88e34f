"""The bridge to a live sharded model: the only code that knows the engine's objects.

`save` and `load` are collective; `model_state` and `optim_state` turn the engine's groups and a
`torch.optim` optimizer's state into checkpoint terms; `rng` carries every rank's random state; `agree`
makes a failure raise on every rank or on none.
"""
