"""The optimizer state's own forms: low-bit codecs."""
