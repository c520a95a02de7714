import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# grappler's variables would change the default rules under the tests' feet
for var in list(os.environ):
    if var.startswith("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"):
        del os.environ[var]

sys.path.insert(0, str(Path(__file__).resolve().parent))
