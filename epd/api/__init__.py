"""The HTTP edge: FastAPI app, OpenAI request parsing and responses, errors, API metrics."""
