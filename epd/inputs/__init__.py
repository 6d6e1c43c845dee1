"""What enters a request: media fetching and prompt building (chat template + placeholders).

    media.py              an image, video or audio part's raw bytes: data: URLs, file://, http(s)
    media_uuids.py        vLLM's media `uuid`: a client-chosen name for an image
    media_item.py         one image, video, video chunk or audio clip from preparation to its encoder (`MediaItem`)
    input_processor.py    a chat's messages and media bytes -> prompt, spans and media items (server and LLM)
    prompt.py             chat messages -> prompt token ids and image / video spans, no pixels decoded
    video_inputs.py       a request's videos planned from their container headers (limits, keys, chunks)
    video_header.py       a video's placeholder tokens from its container header
    audio_header.py       an audio clip's samples counted (its duration bounded from the header first)
    model_files.py        what is read from a checkpoint besides the weights (`ModelFiles`)
    sampling_defaults.py  the sampling values a request gets for the fields it leaves out
"""
