"""The model runner: weights, the KV cache, one step in and its tokens out
(:class:`pitstop.runner.model_runner.ModelRunner`), and its parts: the step as flat tensors,
CUDA graphs (decode, piecewise, verification), sampling on the device, the step in flight."""
