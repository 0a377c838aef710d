"""For A/B runs only: put this folder first on PYTHONPATH and set CHATTTS_SWITCH_INTERVAL_MS, and every Python
process started with it (a server, its engine process) hands the GIL over at that interval instead of 5 ms."""

import os
import sys

_ms = os.environ.get("CHATTTS_SWITCH_INTERVAL_MS")
if _ms:
    sys.setswitchinterval(float(_ms) / 1000)
