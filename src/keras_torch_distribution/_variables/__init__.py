"""Keras variables on N processes: born sharded, initialised block by block,
copies made equal, and what a layout map leaves whole.

Modules, bottom first (a module imports only those above it):

- `copies`: copies of a variable made equal across processes from creation.
- `sharded_init`: initialise only this rank's block of a variable (stream
  and slice).
- `lora_layouts`: LoRA factors laid out along the dims they share with
  the kernel they adapt, where the LayoutMap has no key for them.
- `born_sharded`: Keras variables created as this rank's shards, never
  whole.
- `left_whole`: the warning about large variables a layout map leaves whole.

Nothing is re-exported: importing the package imports none of them.

"""
