"""Video in and out of the pipelines: exact streamed decode and encode, video sources, and clip arguments."""
