"""LoRA fine-tuning: adapters on the projections of a Qwen3.5 model, selected
by their Hugging Face names, and their export as a PEFT adapter."""

from __future__ import annotations

from qwen35_fs2.lora.apply import apply_lora as apply_lora
from qwen35_fs2.lora.apply import hg_module_name as hg_module_name
from qwen35_fs2.lora.apply import lora_parameters as lora_parameters
from qwen35_fs2.lora.config import LORA_TARGET_MODULES as LORA_TARGET_MODULES
from qwen35_fs2.lora.config import LORA_TARGET_PARAMETERS as LORA_TARGET_PARAMETERS
from qwen35_fs2.lora.config import LoraConfig as LoraConfig
from qwen35_fs2.lora.merge import merge_lora_state_dict as merge_lora_state_dict
from qwen35_fs2.lora.peft import PEFT_CONFIG_NAME as PEFT_CONFIG_NAME
from qwen35_fs2.lora.peft import PEFT_WEIGHTS_NAME as PEFT_WEIGHTS_NAME
from qwen35_fs2.lora.peft import check_peft_base as check_peft_base
from qwen35_fs2.lora.peft import save_peft_adapter as save_peft_adapter
