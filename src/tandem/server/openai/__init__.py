"""The OpenAI API of a worker: request bodies, validation, serving and the answers' writers."""
