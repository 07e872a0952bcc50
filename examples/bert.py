"""A BERT-style transformer encoder with configurable depth, classifying token sequences.

    python -m examples.bert --size=tiny --devices=4                     # 2 layers, hidden 32
    python -m examples.bert --size=tiny --model_args='{"num_layers": 8}'
    python -m examples.bert --size=full --devices=8                     # BERT-Large: 24 x 1024

Token + learned position embeddings, then `num_layers` post-norm encoder blocks (multi-head
self-attention, residual, LayerNorm, GELU feed-forward, residual, LayerNorm), then the first
token's vector through a dense classifier. Every block is a run of ordinary Keras layers, so the
planner can cut between any two of them.
"""
TINY = {"num_layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 100, "classes": 4}
FULL = {"num_layers": 24, "hidden": 1024, "heads": 16, "seq_len": 128, "vocab": 30522,
        "classes": 2}
GLOBAL_BATCH = {"tiny": 8, "full": 64}


def build(num_layers=12, hidden=768, heads=12, seq_len=128, vocab=30522, classes=2,
          ffn_multiplier=4):
    import keras
    layers = keras.layers

    class PositionEmbedding(layers.Layer):
        """Adds a learned vector per position."""

        def build(self, input_shape):
            self.table = self.add_weight(name="table", shape=input_shape[1:],
                                         initializer="glorot_uniform")

        def call(self, x):
            return x + self.table

    ids = keras.Input((seq_len,), dtype="int32", name="token_ids")
    h = layers.Embedding(vocab, hidden, name="token_embedding")(ids)
    h = PositionEmbedding(name="position_embedding")(h)
    h = layers.LayerNormalization(name="embedding_norm")(h)
    for i in range(num_layers):
        a = layers.MultiHeadAttention(heads, hidden // heads, name=f"block{i}_attention")(h, h)
        h = layers.LayerNormalization(name=f"block{i}_attention_norm")(
            layers.Add(name=f"block{i}_attention_residual")([h, a]))
        f = layers.Dense(ffn_multiplier * hidden, activation="gelu", name=f"block{i}_ffn_in")(h)
        f = layers.Dense(hidden, name=f"block{i}_ffn_out")(f)
        h = layers.LayerNormalization(name=f"block{i}_ffn_norm")(
            layers.Add(name=f"block{i}_ffn_residual")([h, f]))
    first = layers.Lambda(lambda t: t[:, 0], name="first_token")(h)
    pooled = layers.Dense(hidden, activation="tanh", name="pooler")(first)
    logits = layers.Dense(classes, name="classifier")(pooled)
    return keras.Model(ids, logits, name=f"bert_{num_layers}x{hidden}")


if __name__ == "__main__":
    from examples.run import main_for
    main_for("bert")
