"""vLLM's media `uuid`: an image part may name its image by a client-chosen
uuid, and a later part with the uuid and no url means "the image sent under
that uuid before". `ImagesByUuid` keeps the raw bytes of the latest image
sent under each uuid, least recently used out first, within a count and a
byte budget (one per API process: with --api-servers N a uuid is known to
the process that saw it)."""
from __future__ import annotations

from collections import OrderedDict

MAX_UUID_IMAGES = 256
MAX_UUID_BYTES = 256 << 20


class ImagesByUuid:
    def __init__(self, max_images: int = MAX_UUID_IMAGES, max_bytes: int = MAX_UUID_BYTES):
        self.max_images = max_images
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._images: OrderedDict[str, bytes] = OrderedDict()

    def put(self, uuid: str, data: bytes) -> None:
        old = self._images.pop(uuid, None)
        self.num_bytes -= len(old) if old is not None else 0
        if len(data) > self.max_bytes:
            return
        self._images[uuid] = data
        self.num_bytes += len(data)
        while len(self._images) > self.max_images or self.num_bytes > self.max_bytes:
            _, dropped = self._images.popitem(last=False)
            self.num_bytes -= len(dropped)

    def get(self, uuid: str) -> bytes | None:
        data = self._images.get(uuid)
        if data is not None:
            self._images.move_to_end(uuid)
        return data
