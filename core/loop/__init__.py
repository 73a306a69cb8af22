"""The step loop: the engine plans a step, the model runner launches it on the device
and samples, the previous step's results are applied and emitted. Also one step's
data as values, attention metadata, the memory check before allocating, statistics
and the poisoned-memory debug mode."""
