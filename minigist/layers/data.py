"""Layers that bring data in. They only give shapes: the executor copies each batch into
their output buffers."""
from .base import Layer, register


class DataLayer(Layer):
    is_data = True
    num_bottoms = (0, 0)
    num_tops = (1, 2)
    has_backward = False

    def __init__(self, spec, dtype, engine=None):
        super().__init__(spec, dtype, engine)
        self.batch_override = None
        self.size_override = None
        self.channels_override = None
        self.channels_stated = True     # False: the file gives no channel count (Caffe reads it from the data)

    def override(self, batch_size, input_size, input_channels=None):
        """Batch size, (height, width) and channel count set at load time instead of in the file."""
        self.batch_override = batch_size
        self.size_override = input_size
        self.channels_override = input_channels

    def channels(self, stated):
        """The channel count: the file's `stated` one (None: not stated), which a contradicting
        load-time count may not change; else the load-time count; else 3 (RGB, Caffe's usual)."""
        asked = self.channels_override
        if stated:
            if asked is not None and asked != stated:
                self.fail(f"the file gives {stated} input channel(s); --input-channels / input_channels "
                          f"asks for {asked}")
            return stated
        self.channels_stated = False
        return asked if asked is not None else 3

    def image_shapes(self, batch, channels, height, width):
        """(data, label) shapes after the load-time overrides."""
        if self.batch_override is not None:
            batch = self.batch_override
        if self.size_override is not None:
            height, width = self.size_override
        if not height or not width:
            self.fail("the file gives no input height/width; set the input size when loading")
        if not batch:
            self.fail("the file gives no batch size; set the batch size when loading")
        shapes = [(batch, channels, height, width), (batch,)]
        return shapes[:len(self.spec.tops)]

    def forward(self, xp, x, y, p, saved, ws):
        """Data arrives by copy from the executor before the step."""


@register
class Input(DataLayer):
    type = "Input"
    param_field = "input_param"
    num_tops = (1, None)

    def setup(self, bottom_shapes):
        shapes = [tuple(s.all("dim")) for s in self.p.all("shape")]
        if len(shapes) == 1 and len(self.spec.tops) > 1:
            shapes = shapes * len(self.spec.tops)
        if len(shapes) != len(self.spec.tops):
            self.fail(f"{len(self.spec.tops)} top(s) need 1 or {len(self.spec.tops)} shape(s), got {len(shapes)}")
        out = []
        for index, shape in enumerate(shapes):
            shape = list(shape)
            if self.batch_override is not None and shape:
                shape[0] = self.batch_override
            if index == 0 and len(shape) == 4:     # the images; further tops are other inputs
                shape[1] = self.channels(shape[1])
            if self.size_override is not None and len(shape) == 4:
                shape[2:] = self.size_override
            out.append(tuple(shape))
        return out


@register
class Data(DataLayer):
    """Caffe's LMDB/LevelDB data layer: the batch and crop size come from its parameters, the
    channel count from the data (Caffe reads it from the first record)."""
    type = "Data"
    param_field = "data_param"

    def setup(self, bottom_shapes):
        crop = self.spec.msg.get("transform_param")
        size = crop.get("crop_size", 0) if crop is not None else 0
        size = size or self.p.get("crop_size", 0)
        return self.image_shapes(self.p.get("batch_size", 0), self.channels(None), size, size)


@register
class ImageData(DataLayer):
    type = "ImageData"
    param_field = "image_data_param"

    def setup(self, bottom_shapes):
        transform = self.spec.msg.get("transform_param")
        crop = transform.get("crop_size", 0) if transform is not None else 0
        height = crop or self.p.get("new_height", 0)
        width = crop or self.p.get("new_width", 0)
        # is_color given: Caffe's OpenCV reader makes every image 3 (true) or 1 (false) channels;
        # left out, the data decide (a folder of gray images gives 1)
        stated = (3 if self.p.get("is_color") else 1) if self.p.has("is_color") else None
        channels = self.channels(stated)
        return self.image_shapes(self.p.get("batch_size", 1), channels, height, width)


@register
class MemoryData(DataLayer):
    type = "MemoryData"
    param_field = "memory_data_param"

    def setup(self, bottom_shapes):
        p = self.p
        return self.image_shapes(p.get("batch_size", 0), self.channels(p.get("channels", 0) or None),
                                 p.get("height", 0), p.get("width", 0))
