"""Fine-tuning recipes, each runnable under torchrun on one or many nodes.

    torchrun --nnodes N --nproc-per-node G ... -m mnft.recipes.lora [config=PATH] key=value ...
    python -m mnft.recipes.full max_steps=20          # one process, world size 1

A recipe is one readable file (``lora.py``, ``full.py``); ``config``, ``dist``, ``model``, ``data``,
``checkpointing`` and ``metrics`` are the small shared pieces beside them. See docs/recipes.md.
"""
