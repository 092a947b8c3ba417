"""Data: find the images in a folder (datasets), decode them robustly (images), augment or preprocess them
(transforms) and batch them (loaders).

Bad files never stop a run: files that are not images are dropped (with a warning) when a dataset is built,
by reading only their headers, and files that fail later at full decode (truncated JPEGs) are replaced by the
next good image, flagged in shared memory so that DataLoader workers report back, and summed up once per pass.
"""
