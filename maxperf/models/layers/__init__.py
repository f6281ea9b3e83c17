"""Generic transformer layers: embeddings, norms, attention, MLP, and the decoder layers built from them."""
