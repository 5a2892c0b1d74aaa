"""Suite-wide guard: nothing in the tests may reach Hugging Face (the network rules allow
only loopback and the namespaces the tests create). huggingface_hub reads HF_HUB_OFFLINE
when it is first imported, so it is set here, before any test module imports it; agent
and worker processes started by the tests inherit it."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
