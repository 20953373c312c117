"""The router's process runs without torch.

Nothing the router does needs it (it tokenizes, checks, routes and detokenizes; structured
output schemas are compiled in checker processes of their own, router_svc/schema_check.py),
but transformers, which the tokenizer comes from, imports torch whenever torch is installed.
Measured on a 2-core VM under load (the router's modules imported and the demo's tokenizer
loaded, three runs each): 4.4-8.0 s and 346 MB peak memory with torch, 1.6-2.2 s and 107 MB
without. So `tandem router` marks torch as absent in its process before anything imports
transformers, and transformers then loads its tokenizers alone. A code path that did need torch fails at once with
ModuleNotFoundError (the suite runs real router processes), rather than loading it unnoticed.
"""

from __future__ import annotations

import os
import sys


def keep_torch_out() -> bool:
    """From now on `import torch` fails in this process and libraries that look for torch
    (importlib.util.find_spec) find none. False, and nothing changed, if torch is loaded
    already (the model's directory was built in this process on first use)."""
    if sys.modules.get("torch", None) is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's "absent"
    # transformers says at import that models are unavailable without torch: not news here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return True
