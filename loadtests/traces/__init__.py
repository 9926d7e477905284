"""Trace readers, one per format (mooncake, azure, openai_log), and `formats`, which detects a file's format."""
