"""Developer tools: `epd make-model`."""
