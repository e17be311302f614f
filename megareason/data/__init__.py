"""Prompt data: typed records, loaders for local files and reasoning-gym, chat templating."""

from megareason.data.loaders import load_file, load_reasoning_gym, load_records, parse_row
from megareason.data.prompts import tokenize_prompts
from megareason.data.records import DataError, Document, PromptRecord, TokenizedPrompt

__all__ = [
    "DataError",
    "Document",
    "PromptRecord",
    "TokenizedPrompt",
    "load_file",
    "load_reasoning_gym",
    "load_records",
    "parse_row",
    "tokenize_prompts",
]
