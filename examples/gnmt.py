"""A GNMT-style stacked LSTM encoder-decoder with attention, trained with teacher forcing.

    python -m examples.gnmt --size=tiny --devices=4            # 2+2 LSTM layers of 32 units
    python -m examples.gnmt --size=full --devices=8            # GNMT-16: 8+8 layers of 1024

Encoder: source embedding, a bidirectional LSTM, then LSTMs with residual connections from the
third layer on (as GNMT). Decoder: target embedding (the shifted target sentence, a second model
input that enters the pipeline late), an LSTM whose outputs attend over the encoder's outputs
(Luong-style dot attention), then LSTMs fed with [output, context], residual from the third
layer on, and a per-token softmax over the target vocabulary. The model has two inputs; the
encoder's outputs cross every cut between the encoder and the attention.
"""
TINY = {"layers": 2, "units": 32, "src_len": 8, "tgt_len": 8, "vocab": 64}
FULL = {"layers": 8, "units": 1024, "src_len": 50, "tgt_len": 50, "vocab": 32000}
GLOBAL_BATCH = {"tiny": 8, "full": 128}


def build(layers=4, units=1024, src_len=50, tgt_len=50, vocab=32000):
    import keras
    L = keras.layers
    src = keras.Input((src_len,), dtype="int32", name="source_ids")
    tgt = keras.Input((tgt_len,), dtype="int32", name="target_ids")

    h = L.Embedding(vocab, units, name="source_embedding")(src)
    h = L.Bidirectional(L.LSTM(units // 2, return_sequences=True), name="encoder_lstm0")(h)
    for i in range(1, layers):
        out = L.LSTM(units, return_sequences=True, name=f"encoder_lstm{i}")(h)
        h = L.Add(name=f"encoder_residual{i}")([h, out]) if i >= 2 else out
    encoded = h

    d = L.Embedding(vocab, units, name="target_embedding")(tgt)
    d = L.LSTM(units, return_sequences=True, name="decoder_lstm0")(d)
    context = L.Attention(name="attention")([d, encoded])
    for i in range(1, layers):
        inp = L.Concatenate(name=f"decoder_input{i}")([d, context])
        out = L.LSTM(units, return_sequences=True, name=f"decoder_lstm{i}")(inp)
        d = L.Add(name=f"decoder_residual{i}")([d, out]) if i >= 2 else out
    logits = L.Dense(vocab, name="token_logits")(d)
    return keras.Model([src, tgt], logits, name=f"gnmt_{layers}x{units}")


def labels(model, batch, rng):
    tgt_len, vocab = model.output_shape[1], model.output_shape[-1]
    return rng.randint(0, vocab, size=(batch, tgt_len)).astype("int32")


if __name__ == "__main__":
    from examples.run import main_for
    main_for("gnmt")
