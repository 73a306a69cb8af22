"""The types every layer of the engine shares: a step's attention metadata, its inputs and
outputs, the model's shape, the engine's measurements, and how host values reach the device
(:mod:`.transfer`). Nothing here imports another
sub-package at run time."""
