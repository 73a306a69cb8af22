"""The rollout engine for reinforcement learning (issue 49): weights updated in place,
sleep and wake, a weight-transfer group for a trainer in another process.

One concept per module:

- :mod:`.errors`: the refusals (asleep, busy, a refused weight batch);
- :mod:`.weight_update`: Hugging Face-named tensors checked as a whole batch, then
  copied in place into the model's (merged) parameters through the model plugin's own
  loading map;
- :mod:`.checkpoint_files`: a Hugging Face folder's safetensors, headers first;
- :mod:`.device_memory`: how device memory is released and restored (torch_memory_saver,
  which keeps addresses, or storages freed and re-allocated): the choice in one place;
- :mod:`.sleep`: what ``sleep(level)`` releases and ``wake_up(tags)`` restores;
- :mod:`.transfer`: the weight-transfer process group (TCPStore, gloo or NCCL);
- :mod:`.control`: :class:`~.control.Rollout`, the one object ``LLM`` and the server
  call (the checks that no request is in flight, the prefix cache reset).
"""
