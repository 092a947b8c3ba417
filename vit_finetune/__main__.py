"""`python -m vit_finetune ...` (and `torchrun -m vit_finetune finetune ...`) runs the CLI."""
from .cli import main

main()
