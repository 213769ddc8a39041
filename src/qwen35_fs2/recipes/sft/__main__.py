from __future__ import annotations

import sys

from qwen35_fs2.cli import run_recipe_module

sys.exit(run_recipe_module("instruction_finetune"))
