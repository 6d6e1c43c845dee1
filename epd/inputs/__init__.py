"""What enters a request: media fetching and prompt building (chat template + placeholders)."""
