"""FP8 training: Linear layers that multiply in fp8, and their weights gathered in fp8.

- `config.Float8Config`: the format (e4m3, or hybrid: e5m2 gradients) and the scaling recipe;
- `scaling`: the quantization both paths share (power-of-two scales), so a weight quantized
  on its shard before a gather has exactly the bits of the same weight quantized whole;
- `linear.Float8Linear`: an `nn.Linear` whose matmuls run through `torch._scaled_mm`;
- `convert.convert_to_float8`: swap the Linear layers inside a model's units before `fully_shard`.
"""
