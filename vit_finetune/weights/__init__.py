"""Weights in and out: a model reference resolved to a source (refs, sources, download), a checkpoint's layout
recognised and converted (layouts, transformers_layout), fitted to the native model (loading), model folders
written (saving), and the preprocessing the weights expect (preprocessing)."""
