"""lit configuration of hspmd's FileCheck tests: `lit -v tests/filecheck`.

Each `.mlir` file here runs its `// RUN:` lines in lit's own shell; `hspmd-opt` and
`filecheck` are the commands installed beside the Python that runs lit (the venv's).
"""

import os
import re
import shutil
import sys
import tempfile

import lit.formats

# `config` is the lit.TestingConfig that lit passes to this file

config.name = "hspmd"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.excludes = ["lit.cfg.py"]
config.test_source_root = os.path.dirname(os.path.abspath(__file__))
# lit makes an Output/ folder per test; keep it out of the source tree
config.test_exec_root = os.path.join(tempfile.gettempdir(), f"hspmd-lit-{os.getuid()}")

bin_dir = os.path.dirname(sys.executable)
config.environment["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
# a checkout run with PYTHONPATH (a worktree beside the venv's own install) tests its own code
if os.environ.get("PYTHONPATH"):
    config.environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
for tool in ("hspmd-opt", "filecheck"):
    path = os.path.join(bin_dir, tool)
    if not os.path.exists(path):
        path = shutil.which(tool) or tool
    # not inside a path such as the %s of tests/filecheck/x.mlir
    config.substitutions.append((rf"(?<![\w/.-]){re.escape(tool)}(?![\w/.-])", path))
