"""Import one feature module and write what it computes to result.txt (the demo's proof)."""

import importlib
import sys

feature = importlib.import_module(f"app.feature_{sys.argv[1]}")
value = feature.value()
with open("result.txt", "w") as f:
    f.write(f"{value}\n")
print(f"feature {sys.argv[1]} -> {value}")
