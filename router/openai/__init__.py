"""The OpenAI-compatible HTTP front end: request models, the FastAPI app, response builders."""
