"""``pitstop.model``: the import name the Llama family had before it moved to
:mod:`pitstop.plugins.models.llama` (issue 19). This name *is* that module
(one module object under two names), so every name, attribute and patch of it
is shared."""

import sys

from pitstop.plugins.models import llama

sys.modules[__name__] = llama
