"""Developer tools: `epd make-model`, random-weight checkpoints for tests and benchmarks.

    make_model.py      a random-weight checkpoint in Hugging Face format, of a served family
    make_draft.py      `--draft-of TARGET`: a small draft model with the target's tokenizer
    quantize_model.py  `--quantize`: its linears rewritten in a release format (FP8, INT8, INT4)
    make_eagle3.py     `--preset tiny-eagle3`: a random EAGLE-3 head, in Speculators' format
"""
