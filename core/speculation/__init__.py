"""Speculative decoding in the core: what a proposer is given, exact verification, when
to speculate, and the CUDA graphs of verification steps. The proposers themselves
are plugins (pitstop.plugins.speculative)."""
