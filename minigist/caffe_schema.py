"""The part of Caffe's caffe.proto that model files use, as field-name -> type tables.

A type is a scalar ("string", "bool", "int" (int32), "uint" (uint32), "int64", "float"), an enum name from ENUMS, or a
message name from SCHEMA; a leading "*" marks a repeated field. Message types not listed in
SCHEMA (parameters of layers minigist does not implement) are parsed but not checked, so a
file that uses them fails on the layer type, with a clearer message.
"""

_FILLER = {
    "type": "string", "value": "float", "min": "float", "max": "float", "mean": "float",
    "std": "float", "sparse": "int", "variance_norm": "VarianceNorm",
}

_LAYER_PARAMS = [
    "transform_param", "loss_param", "accuracy_param", "argmax_param", "batch_norm_param",
    "bias_param", "clip_param", "concat_param", "contrastive_loss_param", "convolution_param",
    "crop_param", "data_param", "dropout_param", "dummy_data_param", "eltwise_param",
    "elu_param", "embed_param", "exp_param", "flatten_param", "hdf5_data_param",
    "hdf5_output_param", "hinge_loss_param", "image_data_param", "infogain_loss_param",
    "inner_product_param", "input_param", "log_param", "lrn_param", "memory_data_param",
    "mvn_param", "parameter_param", "pooling_param", "power_param", "prelu_param",
    "python_param", "recurrent_param", "reduction_param", "relu_param", "reshape_param",
    "scale_param", "sigmoid_param", "softmax_param", "spp_param", "slice_param",
    "swish_param", "tanh_param", "threshold_param", "tile_param", "window_data_param",
]

# message type of each *_param field; the ones absent from SCHEMA stay opaque
_PARAM_TYPE = {name: "".join(part.capitalize() for part in name.split("_")[:-1]) + "Parameter"
               for name in _LAYER_PARAMS}
_PARAM_TYPE.update({
    "transform_param": "TransformationParameter", "hdf5_data_param": "HDF5DataParameter",
    "hdf5_output_param": "HDF5OutputParameter", "lrn_param": "LRNParameter",
    "mvn_param": "MVNParameter", "prelu_param": "PReLUParameter", "relu_param": "ReLUParameter",
    "spp_param": "SPPParameter", "elu_param": "ELUParameter", "argmax_param": "ArgMaxParameter",
})

SCHEMA = {
    "NetParameter": {
        "name": "string", "input": "*string", "input_shape": "*BlobShape", "input_dim": "*int",
        "force_backward": "bool", "state": "NetState", "debug_info": "bool",
        "layer": "*LayerParameter", "layers": "*V1LayerParameter",
    },
    "NetState": {"phase": "Phase", "level": "int", "stage": "*string"},
    "NetStateRule": {
        "phase": "Phase", "min_level": "int", "max_level": "int", "stage": "*string",
        "not_stage": "*string",
    },
    "BlobShape": {"dim": "*int64"},
    "BlobProto": {
        "shape": "BlobShape", "data": "*float", "diff": "*float", "double_data": "*float",
        "double_diff": "*float", "num": "int", "channels": "int", "height": "int", "width": "int",
    },
    "ParamSpec": {"name": "string", "share_mode": "DimCheckMode", "lr_mult": "float",
                  "decay_mult": "float"},
    "LayerParameter": dict(
        {"name": "string", "type": "string", "bottom": "*string", "top": "*string",
         "phase": "Phase", "loss_weight": "*float", "param": "*ParamSpec", "blobs": "*BlobProto",
         "propagate_down": "*bool", "include": "*NetStateRule", "exclude": "*NetStateRule"},
        **{name: _PARAM_TYPE[name] for name in _LAYER_PARAMS}),
    "V1LayerParameter": dict(
        {"bottom": "*string", "top": "*string", "name": "string", "include": "*NetStateRule",
         "exclude": "*NetStateRule", "type": "V1LayerType", "blobs": "*BlobProto",
         "param": "*string", "blob_share_mode": "*DimCheckMode", "blobs_lr": "*float",
         "weight_decay": "*float", "loss_weight": "*float", "layer": "V0LayerParameter"},
        **{name: _PARAM_TYPE[name] for name in _LAYER_PARAMS}),
    "FillerParameter": _FILLER,
    "ConvolutionParameter": {
        "num_output": "uint", "bias_term": "bool", "pad": "*uint", "kernel_size": "*uint",
        "stride": "*uint", "dilation": "*uint", "pad_h": "uint", "pad_w": "uint",
        "kernel_h": "uint", "kernel_w": "uint", "stride_h": "uint", "stride_w": "uint",
        "group": "uint", "weight_filler": "FillerParameter", "bias_filler": "FillerParameter",
        "engine": "Engine", "axis": "int", "force_nd_im2col": "bool",
    },
    "InnerProductParameter": {
        "num_output": "uint", "bias_term": "bool", "weight_filler": "FillerParameter",
        "bias_filler": "FillerParameter", "axis": "int", "transpose": "bool",
    },
    "PoolingParameter": {
        "pool": "PoolMethod", "pad": "uint", "pad_h": "uint", "pad_w": "uint",
        "kernel_size": "uint", "kernel_h": "uint", "kernel_w": "uint", "stride": "uint",
        "stride_h": "uint", "stride_w": "uint", "engine": "Engine", "global_pooling": "bool",
        "round_mode": "RoundMode",
        "ceil_mode": "bool",    # not in BVLC Caffe: a fork's spelling of round_mode (DenseNet's files)
    },
    "ReLUParameter": {"negative_slope": "float", "engine": "Engine"},
    "DropoutParameter": {"dropout_ratio": "float", "scale_train": "bool"},
    "BatchNormParameter": {"use_global_stats": "bool", "moving_average_fraction": "float",
                           "eps": "float"},
    "ScaleParameter": {"axis": "int", "num_axes": "int", "filler": "FillerParameter",
                       "bias_term": "bool", "bias_filler": "FillerParameter"},
    "LRNParameter": {"local_size": "uint", "alpha": "float", "beta": "float",
                     "norm_region": "NormRegion", "k": "float", "engine": "Engine"},
    "ConcatParameter": {"axis": "int", "concat_dim": "uint"},
    "EltwiseParameter": {"operation": "EltwiseOp", "coeff": "*float",
                         "stable_prod_grad": "bool"},
    "FlattenParameter": {"axis": "int", "end_axis": "int"},
    "SoftmaxParameter": {"engine": "Engine", "axis": "int"},
    "LossParameter": {"ignore_label": "int", "normalization": "NormalizationMode",
                      "normalize": "bool"},
    "AccuracyParameter": {"top_k": "uint", "axis": "int", "ignore_label": "int"},
    "InputParameter": {"shape": "*BlobShape"},
    "DataParameter": {
        "source": "string", "batch_size": "uint", "rand_skip": "uint", "backend": "DB",
        "scale": "float", "mean_file": "string", "crop_size": "uint", "mirror": "bool",
        "force_encoded_color": "bool", "prefetch": "uint",
    },
    "ImageDataParameter": {
        "source": "string", "batch_size": "uint", "rand_skip": "uint", "shuffle": "bool",
        "new_height": "uint", "new_width": "uint", "is_color": "bool", "scale": "float",
        "mean_file": "string", "crop_size": "uint", "mirror": "bool", "root_folder": "string",
    },
    "MemoryDataParameter": {"batch_size": "uint", "channels": "uint", "height": "uint",
                            "width": "uint"},
    "DummyDataParameter": {"data_filler": "*FillerParameter", "shape": "*BlobShape",
                           "num": "*uint", "channels": "*uint", "height": "*uint",
                           "width": "*uint"},
    "HDF5DataParameter": {"source": "string", "batch_size": "uint", "shuffle": "bool"},
    "WindowDataParameter": {
        "source": "string", "scale": "float", "mean_file": "string", "batch_size": "uint",
        "crop_size": "uint", "mirror": "bool", "fg_threshold": "float", "bg_threshold": "float",
        "fg_fraction": "float", "context_pad": "uint", "crop_mode": "string",
        "cache_images": "bool", "root_folder": "string",
    },
    "TransformationParameter": {
        "scale": "float", "mirror": "bool", "crop_size": "uint", "mean_file": "string",
        "mean_value": "*float", "force_color": "bool", "force_gray": "bool",
    },
}

ENUMS = {
    "Phase": ("TRAIN", "TEST"),
    "VarianceNorm": ("FAN_IN", "FAN_OUT", "AVERAGE"),
    "DimCheckMode": ("STRICT", "PERMISSIVE"),
    "Engine": ("DEFAULT", "CAFFE", "CUDNN"),
    "PoolMethod": ("MAX", "AVE", "STOCHASTIC"),
    "RoundMode": ("CEIL", "FLOOR"),
    "NormRegion": ("ACROSS_CHANNELS", "WITHIN_CHANNEL"),
    "EltwiseOp": ("PROD", "SUM", "MAX"),
    "NormalizationMode": ("FULL", "VALID", "BATCH_SIZE", "NONE"),
    "DB": ("LEVELDB", "LMDB"),
    "V1LayerType": (
        "NONE", "ACCURACY", "BNLL", "CONCAT", "CONVOLUTION", "DATA", "DROPOUT",
        "EUCLIDEAN_LOSS", "FLATTEN", "HDF5_DATA", "HDF5_OUTPUT", "IM2COL", "IMAGE_DATA",
        "INFOGAIN_LOSS", "INNER_PRODUCT", "LRN", "MULTINOMIAL_LOGISTIC_LOSS", "POOLING",
        "RELU", "SIGMOID", "SOFTMAX", "SOFTMAX_LOSS", "SPLIT", "TANH", "WINDOW_DATA",
        "ELTWISE", "POWER", "SIGMOID_CROSS_ENTROPY_LOSS", "HINGE_LOSS", "MEMORY_DATA",
        "ARGMAX", "THRESHOLD", "DUMMY_DATA", "SLICE", "MVN", "ABSVAL", "SILENCE",
        "CONTRASTIVE_LOSS", "EXP", "DECONVOLUTION",
    ),
}

# legacy upper-case type names of the `layers { }` syntax -> current type strings
V1_TYPE_NAMES = {
    "ACCURACY": "Accuracy", "BNLL": "BNLL", "CONCAT": "Concat", "CONVOLUTION": "Convolution",
    "DATA": "Data", "DROPOUT": "Dropout", "EUCLIDEAN_LOSS": "EuclideanLoss",
    "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "IM2COL": "Im2col", "IMAGE_DATA": "ImageData", "INFOGAIN_LOSS": "InfogainLoss",
    "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss", "POOLING": "Pooling",
    "RELU": "ReLU", "SIGMOID": "Sigmoid", "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "TANH": "TanH",
    "WINDOW_DATA": "WindowData", "ELTWISE": "Eltwise", "POWER": "Power",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "HINGE_LOSS": "HingeLoss",
    "MEMORY_DATA": "MemoryData", "ARGMAX": "ArgMax", "THRESHOLD": "Threshold",
    "DUMMY_DATA": "DummyData", "SLICE": "Slice", "MVN": "MVN", "ABSVAL": "AbsVal",
    "SILENCE": "Silence", "CONTRASTIVE_LOSS": "ContrastiveLoss", "EXP": "Exp",
    "DECONVOLUTION": "Deconvolution",
}
