"""Model architectures, one file each, and the Hugging Face-layout loader."""
