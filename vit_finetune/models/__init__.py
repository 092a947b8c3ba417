"""The native Vision Transformer: its layers, the model, position embedding resizing, and the architecture table
(archs.json, generated from timm). Nothing here reads or writes files other than the table."""
