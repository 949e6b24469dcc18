"""Layers that bring data in. They only give shapes: the executor copies each batch into
their output buffers."""
from .base import Layer, register


class DataLayer(Layer):
    is_data = True
    num_bottoms = (0, 0)
    num_tops = (1, 2)
    has_backward = False

    def __init__(self, spec, dtype):
        super().__init__(spec, dtype)
        self.batch_override = None
        self.size_override = None

    def override(self, batch_size, input_size):
        """Batch size and (height, width) set at load time instead of in the file."""
        self.batch_override = batch_size
        self.size_override = input_size

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
        for shape in shapes:
            shape = list(shape)
            if self.batch_override is not None and shape:
                shape[0] = self.batch_override
            if self.size_override is not None and len(shape) == 4:
                shape[2:] = self.size_override
            out.append(tuple(shape))
        return out


@register
class Data(DataLayer):
    """Caffe's LMDB/LevelDB data layer: the shapes come from its parameters (channels: 3)."""
    type = "Data"
    param_field = "data_param"

    def setup(self, bottom_shapes):
        crop = self.spec.msg.get("transform_param")
        size = crop.get("crop_size", 0) if crop is not None else 0
        size = size or self.p.get("crop_size", 0)
        return self.image_shapes(self.p.get("batch_size", 0), 3, size, size)


@register
class ImageData(DataLayer):
    type = "ImageData"
    param_field = "image_data_param"

    def setup(self, bottom_shapes):
        transform = self.spec.msg.get("transform_param")
        crop = transform.get("crop_size", 0) if transform is not None else 0
        height = crop or self.p.get("new_height", 0)
        width = crop or self.p.get("new_width", 0)
        channels = 3 if self.p.get("is_color", True) else 1
        return self.image_shapes(self.p.get("batch_size", 1), channels, height, width)


@register
class MemoryData(DataLayer):
    type = "MemoryData"
    param_field = "memory_data_param"

    def setup(self, bottom_shapes):
        p = self.p
        return self.image_shapes(p.get("batch_size", 0), p.get("channels", 0),
                                 p.get("height", 0), p.get("width", 0))
