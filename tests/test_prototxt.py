"""The model-file reader: Caffe's prototxt text format (current `layer { }` and legacy
`layers { }` syntax), checked against Caffe's schema, and the graph built from it (phase
rules, in-place blobs in SSA form, net-level inputs, load-time overrides), with every
mistake a user can make reported as `path:line: message`."""
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minigist import build_graph, prototxt
from minigist.errors import ModelFileError
from minigist.layers import LAYER_TYPES

DATA = Path(__file__).parent / "data"
TRAIN_VAL = DATA / "zoo_mlp_train_val.prototxt"
DEPLOY = DATA / "zoo_mlp_deploy.prototxt"
LEGACY = DATA / "legacy_mlp.prototxt"
CONVNET = DATA / "zoo_convnet_train_val.prototxt"


def parse(text, root="NetParameter"):
    return prototxt.parse(textwrap.dedent(text), "t.prototxt", root)


def values(msg):
    return [(name, value) for name, value, _ in msg.fields]


def names(graph):
    return [layer.name for layer in graph.layers]


def shapes(graph):
    return {name: blob.shape for name, blob in graph.blobs.items()}


def params_of(graph, layer_name):
    return [(p.name, p.shape, p.lr_mult, p.decay_mult) for p in graph.node_of(layer_name).layer.params]


# A net-level input used by the inline nets below (3 lines).
HEAD = '''name: "t"
input: "data"
input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
'''


def net(body):
    return HEAD + textwrap.dedent(body).lstrip("\n")


# ---- tokens and values ----------------------------------------------------------------------

def test_comments_are_skipped_anywhere():
    msg = parse('''\
        # a whole-line comment with { braces } and "quotes
        name: "n"   # trailing comment
        layer {  # after an opening brace
          # inside a block
          name: "a # not a comment"  type: "ReLU"  # after two fields
        }
        # last line, no newline at the end''')
    assert msg.get("name") == "n"
    layer = msg.get("layer")
    assert layer.get("name") == "a # not a comment" and layer.get("type") == "ReLU"
    assert (layer.line, layer.line_of("name")) == (3, 5)


def test_strings_with_escapes_and_single_quotes():
    msg = parse(r'''
        bottom: "quote \" inside"
        bottom: "back\\slash"
        bottom: "tab\there\nnewline\r"
        bottom: "octal \101\102 and hex \x43\x44"
        bottom: 'single "quoted" \' string'
        bottom: ""
        bottom: "C:\\data\\train_lmdb"
    ''', root="LayerParameter")
    assert msg.all("bottom") == ['quote " inside', "back\\slash", "tab\there\nnewline\r",
                                 "octal AB and hex CD", "single \"quoted\" ' string", "",
                                 "C:\\data\\train_lmdb"]


def test_numbers_in_all_forms():
    msg = parse('''
        coeff: 1 coeff: -2 coeff: +3 coeff: 1e-3 coeff: 2.5E+2 coeff: .5 coeff: -.25
        coeff: 5. coeff: 1.0f coeff: 2F coeff: 1e3f
        coeff: inf coeff: -inf coeff: Infinity coeff: -INF
    ''', root="EltwiseParameter")
    got = msg.all("coeff")
    assert got == [1.0, -2.0, 3.0, 1e-3, 250.0, 0.5, -0.25, 5.0, 1.0, 2.0, 1000.0,
                   math.inf, -math.inf, math.inf, -math.inf]
    assert all(type(v) is float for v in got)
    assert math.isnan(parse("std: nan", root="FillerParameter").get("std"))
    assert math.isnan(parse("std: NaN", root="FillerParameter").get("std"))
    dims = parse("dim: 10 dim: -2 dim: +3 dim: 0 dim: 007", root="BlobShape").all("dim")
    assert dims == [10, -2, 3, 0, 7] and all(type(d) is int for d in dims)


def test_words_that_start_like_inf_or_nan_are_names():
    assert parse("type: INFOGAIN_LOSS", root="V1LayerParameter").get("type") == "INFOGAIN_LOSS"
    assert parse("infogain_loss_param { source: 'h' }", root="LayerParameter").has("infogain_loss_param")
    with pytest.raises(ModelFileError, match="takes an integer, found inf"):
        parse("num_output: inf", root="InnerProductParameter")
    with pytest.raises(ModelFileError, match="takes an integer, found 1e3"):
        parse("num_output: 1e3", root="InnerProductParameter")


def test_bools():
    msg = parse('''propagate_down: true propagate_down: false propagate_down: True
                   propagate_down: FALSE propagate_down: 1 propagate_down: 0
                   propagate_down: t propagate_down: f''', root="LayerParameter")
    assert msg.all("propagate_down") == [True, False, True, False, True, False, True, False]


def test_enums_unquoted_quoted_or_by_number():
    msg = parse('''
        include { phase: TRAIN }
        include { phase: "TEST" }
        include { phase: 1 }
        exclude { phase: 0 }
    ''', root="LayerParameter")
    assert [rule.get("phase") for rule in msg.all("include")] == ["TRAIN", "TEST", "TEST"]
    assert msg.get("exclude").get("phase") == "TRAIN"
    pool = parse("pool: AVE engine: 'CUDNN' round_mode: FLOOR", root="PoolingParameter")
    assert values(pool) == [("pool", "AVE"), ("engine", "CUDNN"), ("round_mode", "FLOOR")]


def test_nested_blocks_with_or_without_colon_and_angle_brackets():
    msg = parse('''
        layer {
          name: "ip"
          inner_product_param: {
            num_output: 10
            weight_filler < type: "gaussian" std: 0.01 >
            bias_filler: < type: "constant" value: 0.2 >
          }
          include: { }
        }
        layer < name: "angle" >
    ''')
    first, second = msg.all("layer")
    ip = first.get("inner_product_param")
    assert ip.type_name == "InnerProductParameter" and ip.get("num_output") == 10
    assert values(ip.get("weight_filler")) == [("type", "gaussian"), ("std", 0.01)]
    assert values(ip.get("bias_filler")) == [("type", "constant"), ("value", 0.2)]
    assert first.get("include").type_name == "NetStateRule" and first.get("include").fields == []
    assert second.get("name") == "angle"
    # each message records the line its field name is on
    assert (first.line, ip.line, ip.get("weight_filler").line, second.line) == (2, 4, 6, 11)


def test_repeated_fields_keep_file_order_and_lines():
    msg = parse('''
        name: "ip"
        bottom: "a"
        top: "b"
        bottom: "c"
        param { lr_mult: 1 }
        param { lr_mult: 2 decay_mult: 0 }
    ''', root="LayerParameter")
    assert msg.all("bottom") == ["a", "c"] and msg.get("bottom") == "a"
    assert msg.all("top") == ["b"] and msg.all("loss_weight") == []
    assert [p.get("lr_mult") for p in msg.all("param")] == [1.0, 2.0]
    assert msg.all("param")[1].get("decay_mult") == 0.0
    assert msg.get("param").get("decay_mult", 1.0) == 1.0
    assert (msg.line_of("name"), msg.line_of("bottom"), msg.line_of("top")) == (2, 3, 4)
    assert [line for name, _, line in msg.fields if name == "bottom"] == [3, 5]
    assert not msg.has("loss_weight") and msg.has("param")


def test_list_syntax():
    assert parse("dim: [1, 2, 3]", root="BlobShape").all("dim") == [1, 2, 3]
    # a block's ':' is optional
    assert parse("shape [{ dim: 4 }]", root="InputParameter").get("shape").all("dim") == [4]
    assert parse("dim: []", root="BlobShape").all("dim") == []
    assert parse("dim: 1 dim: [2, 3] dim: 4", root="BlobShape").all("dim") == [1, 2, 3, 4]
    multi = parse("dim: [\n  10,\n  3,\n]\n", root="BlobShape")
    assert values(multi) == [("dim", 10), ("dim", 3)]
    assert [line for _, _, line in multi.fields] == [2, 3]
    shapes_msg = parse("shape: [{ dim: 1 }, < dim: 2 dim: 3 >]", root="InputParameter")
    assert [s.all("dim") for s in shapes_msg.all("shape")] == [[1], [2, 3]]
    assert parse('top: ["a", "b"]', root="LayerParameter").all("top") == ["a", "b"]


def test_fields_separated_by_newlines_spaces_semicolons_and_commas():
    msg = parse('name: "a"; type: "ReLU", bottom: "x" top: "x";;\n\tinclude { phase: TEST; }',
                root="LayerParameter")
    assert values(msg)[:4] == [("name", "a"), ("type", "ReLU"), ("bottom", "x"), ("top", "x")]
    assert msg.get("include").get("phase") == "TEST"


def test_messages_minigist_does_not_interpret_are_kept_opaque():
    msg = parse('''
        name: "py"
        type: "Python"
        python_param {
          module: "my_layers"
          layer: 'Loss'
          param_str: "{'weight': 2}"
          anything { nested: 1 deeper < x: ENUM_LIKE > }
        }
    ''', root="LayerParameter")
    py = msg.get("python_param")
    assert py.get("module") == "my_layers" and py.get("layer") == "Loss"
    assert py.get("param_str") == "{'weight': 2}"
    assert py.get("anything").get("nested") == "1"
    assert py.get("anything").get("deeper").get("x") == "ENUM_LIKE"


def test_windows_line_ends_and_byte_order_mark(tmp_path):
    text = TRAIN_VAL.read_text()
    path = tmp_path / "crlf.prototxt"
    path.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    for phase in ("TRAIN", "TEST"):
        plain, crlf = build_graph(str(TRAIN_VAL), phase), build_graph(str(path), phase)
        assert names(crlf) == names(plain) and shapes(crlf) == shapes(plain)
    path.write_bytes(b"\xef\xbb\xbf" + text.replace("batch_size: 50", "batch_size: -50").replace("\n", "\r\n").encode())
    with pytest.raises(ModelFileError) as info:
        build_graph(str(path), "TEST")
    line = text.splitlines().index("    batch_size: 50") + 1
    assert str(info.value).startswith(f"{path}:{line}: ") and "negative" in str(info.value)


# ---- model-zoo style files ------------------------------------------------------------------

TRAIN_LAYERS = ["data", "fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8", "loss"]
TEST_LAYERS = TRAIN_LAYERS[:-1] + ["accuracy", "accuracy_top5", "loss"]


@pytest.mark.parametrize("phase, batch, layers", [("TRAIN", 256, TRAIN_LAYERS), ("TEST", 50, TEST_LAYERS)])
def test_train_val_file_builds_each_phase(phase, batch, layers):
    graph = build_graph(str(TRAIN_VAL), phase)
    assert graph.name == "ZooMLP" and graph.phase == phase and graph.path == str(TRAIN_VAL)
    assert names(graph) == layers
    assert [layer.type for layer in graph.layers][:2] == ["Data", "InnerProduct"]
    data = graph.node_of("data")
    # the phase's own Data layer: batch_size from data_param, 3 channels, crop_size from transform_param
    source = data.layer.spec.msg.get("data_param").get("source")
    assert source.endswith("_train_lmdb" if phase == "TRAIN" else "_val_lmdb")
    assert data.tops == ["data", "label"]
    assert graph.blobs["data"].shape == (batch, 3, 227, 227) and graph.blobs["label"].shape == (batch,)
    assert (graph.batch_size, graph.input_shape) == (batch, (3, 227, 227))
    assert graph.blobs["fc6"].shape == (batch, 4096) and graph.blobs["fc8"].shape == (batch, 1000)
    assert graph.blobs["loss"].shape == () and graph.loss_weights == {"loss": 1.0}
    expected_outputs = ["loss"] if phase == "TRAIN" else ["accuracy", "accuracy_top5", "loss"]
    assert sorted(graph.outputs()) == expected_outputs
    assert graph.node_of("drop6").layer.train == (phase == "TRAIN")
    if phase == "TEST":
        assert graph.node_of("accuracy").layer.top_k == 1
        assert graph.node_of("accuracy_top5").layer.top_k == 5
        # fc8 feeds both accuracies and the loss; the label is each one's second bottom
        fc8_users = [names(graph)[i] for i, _ in graph.blobs["fc8"].consumers]
        assert fc8_users == ["accuracy", "accuracy_top5", "loss"]
        assert [b for _, b in graph.blobs["label"].consumers] == [1, 1, 1]


def test_train_val_file_fields_are_read_as_written():
    graph = build_graph(str(TRAIN_VAL), "TRAIN")
    msg = graph.node_of("data").layer.spec.msg
    transform = msg.get("transform_param")
    assert values(transform) == [("mirror", True), ("crop_size", 227),
                                 ("mean_file", "data/ilsvrc12/imagenet_mean.binaryproto")]
    assert values(msg.get("data_param"))[1:] == [("batch_size", 256), ("backend", "LMDB")]
    test_data = build_graph(str(TRAIN_VAL), "TEST").node_of("data").layer.spec.msg
    assert test_data.get("data_param").get("backend") == "LMDB"   # written quoted
    assert test_data.get("transform_param").get("mirror") is False
    assert params_of(graph, "fc6") == [("weight", (4096, 3 * 227 * 227), 1.0, 1.0),
                                       ("bias", (4096,), 2.0, 0.0)]
    fc8 = graph.node_of("fc8").layer
    assert [(p.filler["type"], p.filler["std"], p.filler["value"]) for p in fc8.params] == \
        [("gaussian", 0.01, 0.0), ("constant", 1.0, 0.0)]
    assert graph.node_of("fc6").layer.params[1].filler["value"] == 0.1
    assert graph.node_of("relu6").layer.spec.msg.get("relu_param").get("engine") == "CAFFE"
    assert graph.param_count() == sum(int(np.prod(p.shape)) for layer in graph.layers for p in layer.params)


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_deploy_file_with_net_level_input(phase):
    graph = build_graph(str(DEPLOY), phase)
    assert names(graph) == ["input", "fc6", "relu6", "drop6", "fc7", "relu7", "drop7", "fc8", "prob"]
    node = graph.nodes[0]
    assert node.layer.type == "Input" and node.tops == ["data"] and node.bottoms == []
    assert node.layer.spec.line == 5          # the line of `input: "data"`
    assert graph.blobs["data"].shape == (10, 3, 227, 227)
    assert (graph.batch_size, graph.input_shape) == (10, (3, 227, 227))
    assert graph.blobs["prob"].shape == (10, 1000) and graph.outputs() == ["prob"]
    assert graph.loss_weights == {}
    assert graph.node_of("drop7").layer.train == (phase == "TRAIN")


def test_deploy_forms_of_the_input_all_agree():
    body = '''
        layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 7 } }
    '''
    forms = [
        'input: "data"\ninput_dim: 5 input_dim: 3 input_dim: 8 input_dim: 6\n',
        'input: "data"\ninput_shape { dim: 5 dim: 3 dim: 8 dim: 6 }\n',
        'input: "data"\ninput_shape: { dim: [5, 3, 8, 6] }\n',
        'layer { name: "input" type: "Input" top: "data" input_param { shape: { dim: 5 dim: 3 dim: 8 dim: 6 } } }\n',
    ]
    for form in forms:
        graph = build_graph(form + textwrap.dedent(body), path="deploy.prototxt")
        assert names(graph) == ["input", "fc"]
        assert graph.blobs["data"].shape == (5, 3, 8, 6) and graph.blobs["fc"].shape == (5, 7)
    # input_shape wins over input_dim when a file gives both, as in Caffe
    both = 'input: "data"\ninput_shape { dim: 1 dim: 3 dim: 2 dim: 2 }\ninput_dim: 9\n'
    assert build_graph(both + textwrap.dedent(body), path="d").blobs["data"].shape == (1, 3, 2, 2)


def test_two_net_level_inputs():
    graph = build_graph('''
        input: "data"
        input_dim: 4 input_dim: 3 input_dim: 5 input_dim: 5
        input: "label"
        input_dim: 4 input_dim: 1 input_dim: 1 input_dim: 1
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 6 } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    ''', path="two.prototxt")
    assert graph.nodes[0].tops == ["data", "label"]
    assert shapes(graph) == {"data": (4, 3, 5, 5), "label": (4, 1, 1, 1), "ip": (4, 6), "loss": ()}


def test_convnet_style_file_parses_as_it_is():
    """Parsing only (no layer classes needed): the fields of conv, pooling and LRN layers."""
    msg = prototxt.parse_file(str(CONVNET))
    layers = {layer.get("name"): layer for layer in msg.all("layer") if layer.get("name") != "data"}
    conv1 = layers["conv1"].get("convolution_param")
    assert values(conv1)[:4] == [("num_output", 32), ("kernel_size", 5), ("stride", 2), ("pad", 2)]
    assert conv1.get("engine") == "CAFFE" and conv1.get("weight_filler").get("std") == 0.01
    assert layers["conv2"].get("convolution_param").get("group") == 2
    assert values(layers["pool1"].get("pooling_param")) == [("pool", "MAX"), ("kernel_size", 3), ("stride", 2)]
    assert values(layers["pool2"].get("pooling_param")) == [("pool", "AVE"), ("global_pooling", True)]
    lrn = layers["norm1"].get("lrn_param")
    assert values(lrn) == [("local_size", 5), ("alpha", 0.0001), ("beta", 0.75), ("norm_region", "ACROSS_CHANNELS")]
    data = msg.all("layer")[0]
    assert data.get("transform_param").all("mean_value") == [104.0, 117.0, 123.0]


HAS_CONV_POOL = "Convolution" in LAYER_TYPES and "Pooling" in LAYER_TYPES


@pytest.mark.skipif(not HAS_CONV_POOL, reason="needs the Convolution and Pooling layers")
@pytest.mark.parametrize("phase, batch", [("TRAIN", 32), ("TEST", 16)])
def test_convnet_style_file_builds(phase, batch):
    graph = build_graph(str(CONVNET), phase)
    expected = ["data", "conv1", "relu1", "norm1", "pool1", "conv2", "relu2", "pool2", "fc", "loss"]
    if phase == "TEST":
        expected.insert(-1, "accuracy")
    assert names(graph) == expected
    assert shapes(graph)["data"] == (batch, 3, 64, 64)
    assert [graph.blobs[b].shape[1:] for b in ("conv1@relu1", "norm1", "pool1", "conv2@relu2", "pool2", "fc")] == \
        [(32, 32, 32), (32, 32, 32), (32, 16, 16), (64, 16, 16), (64, 1, 1), (10,)]
    assert params_of(graph, "conv2") == [("weight", (64, 16, 3, 3), 1.0, 1.0), ("bias", (64,), 2.0, 0.0)]
    small = build_graph(str(CONVNET), phase, batch_size=4, input_size=48)
    assert small.blobs["data"].shape == (4, 3, 48, 48) and small.blobs["pool1"].shape == (4, 32, 12, 12)
    # an input too small for pool1's 3x3 window is reported at pool1
    pool1_line = next(layer.line for layer in prototxt.parse_file(str(CONVNET)).all("layer")
                      if layer.get("name") == "pool1")
    with pytest.raises(ModelFileError) as info:
        build_graph(str(CONVNET), phase, input_size=2)
    assert str(info.value).startswith(f"{CONVNET}:{pool1_line}: layer 'pool1' (Pooling)")


# ---- legacy `layers { }` syntax -------------------------------------------------------------

@pytest.mark.parametrize("phase, batch", [("TRAIN", 64), ("TEST", 100)])
def test_legacy_file_builds_with_multipliers(phase, batch):
    graph = build_graph(str(LEGACY), phase)
    expected = ["cifar", "ip1", "relu1", "ip2", "loss"]
    if phase == "TEST":
        expected.insert(4, "accuracy")
    assert names(graph) == expected
    types = {layer.name: layer.type for layer in graph.layers}
    assert types["cifar"] == "Data" and types["ip1"] == "InnerProduct" and types["relu1"] == "ReLU"
    assert types["loss"] == "SoftmaxWithLoss"
    assert graph.blobs["data"].shape == (batch, 3, 32, 32)   # crop_size from data_param
    assert graph.blobs["ip1@relu1"].shape == (batch, 500)
    assert params_of(graph, "ip1") == [("weight", (500, 3 * 32 * 32), 1.0, 1.0), ("bias", (500,), 2.0, 0.0)]
    assert params_of(graph, "ip2") == [("weight", (10, 500), 0.5, 2.0), ("bias", (10,), 1.0, 0.0)]
    assert graph.loss_weights == {"loss": 1.0}
    assert graph.node_of("ip1").layer.params[0].filler["type"] == "xavier"
    if phase == "TEST":
        assert graph.node_of("accuracy").layer.type == "Accuracy"


def test_legacy_small_net_inline():
    graph = build_graph('''
        name: "legacy"
        input: "data"
        input_dim: 2
        input_dim: 3
        input_dim: 4
        input_dim: 4
        layers { name: "flat" type: FLATTEN bottom: "data" top: "flat" }
        layers {
          name: "ip1" type: INNER_PRODUCT bottom: "flat" top: "ip1"
          blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
          inner_product_param { num_output: 6 }
        }
        layers {
          name: "ip2" type: 14 bottom: "flat" top: "ip2"
          blobs_lr: 0 blobs_lr: 0
          inner_product_param { num_output: 6 bias_term: false }
        }
        layers { name: "relu" type: RELU bottom: "ip1" top: "ip1" }
        layers { name: "drop" type: DROPOUT bottom: "ip2" top: "ip2" dropout_param { dropout_ratio: 0.25 } }
        layers { name: "sum" type: ELTWISE bottom: "ip1" bottom: "ip2" top: "sum" eltwise_param { operation: SUM coeff: 1 coeff: -1 } }
        layers { name: "cat" type: CONCAT bottom: "sum" bottom: "ip1" top: "cat" concat_param { concat_dim: 1 } }
        layers { name: "prob" type: SOFTMAX bottom: "cat" top: "prob" }
    ''', path="legacy.prototxt")
    assert [layer.type for layer in graph.layers] == ["Input", "Flatten", "InnerProduct", "InnerProduct",
                                                      "ReLU", "Dropout", "Eltwise", "Concat", "Softmax"]
    assert params_of(graph, "ip1") == [("weight", (6, 48), 1.0, 1.0), ("bias", (6,), 2.0, 0.0)]
    # blobs_lr without weight_decay: decay_mult keeps its default 1; lr 0 freezes
    assert params_of(graph, "ip2") == [("weight", (6, 48), 0.0, 1.0)]
    assert not graph.node_of("ip2").layer.params[0].trained
    assert graph.node_of("sum").bottoms == ["ip1@relu", "ip2@drop"]
    assert graph.node_of("cat").bottoms == ["sum", "ip1@relu"]
    assert graph.blobs["cat"].shape == (2, 12) and graph.node_of("sum").layer.coeff == [1.0, -1.0]


# ---- phase rules ----------------------------------------------------------------------------

def test_include_and_exclude_rules():
    text = net('''
        layer { name: "always" type: "ReLU" bottom: "data" top: "a" }
        layer { name: "train_only" type: "ReLU" bottom: "data" top: "b" include { phase: TRAIN } }
        layer { name: "test_only" type: "ReLU" bottom: "data" top: "c" include { phase: TEST } }
        layer { name: "not_in_test" type: "ReLU" bottom: "data" top: "d" exclude { phase: TEST } }
        layer { name: "not_in_train" type: "ReLU" bottom: "data" top: "e" exclude: { phase: TRAIN } }
        layer { name: "either" type: "ReLU" bottom: "data" top: "f" include { phase: TRAIN } include { phase: TEST } }
        layer { name: "no_phase" type: "ReLU" bottom: "data" top: "g" include { } }
        layer { name: "staged" type: "ReLU" bottom: "data" top: "h" include { phase: TRAIN stage: "deploy" } }
        layer { name: "not_staged" type: "ReLU" bottom: "data" top: "i" include { not_stage: "deploy" } }
        layer { name: "leveled" type: "ReLU" bottom: "data" top: "j" include { min_level: 1 } }
        layer { name: "max_level" type: "ReLU" bottom: "data" top: "k" include { max_level: -1 } }
        layer { name: "excl_stage" type: "ReLU" bottom: "data" top: "l" exclude { stage: "deploy" } }
    ''')
    common = ["input", "always", "either", "no_phase", "not_staged", "excl_stage"]
    train = names(build_graph(text, "TRAIN", path="rules.prototxt"))
    test = names(build_graph(text, "TEST", path="rules.prototxt"))
    assert sorted(train) == sorted(common + ["train_only", "not_in_test"])
    assert sorted(test) == sorted(common + ["test_only", "not_in_train"])


def test_same_top_from_layers_of_different_phases():
    text = net('''
        layer { name: "fc_train" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } include { phase: TRAIN } }
        layer { name: "fc_test" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 5 } include { phase: TEST } }
        layer { name: "relu" type: "ReLU" bottom: "fc" top: "fc" }
    ''')
    assert build_graph(text, "TRAIN", path="p").blobs["fc@relu"].shape == (2, 3)
    assert build_graph(text, "TEST", path="p").blobs["fc@relu"].shape == (2, 5)
    with pytest.raises(ValueError, match="TRAIN or TEST"):
        build_graph(text, "DEPLOY", path="p")


# ---- in-place blobs in SSA form -------------------------------------------------------------

def test_in_place_layers_make_new_blob_versions():
    graph = build_graph(str(DEPLOY), "TRAIN")
    index = {name: i for i, name in enumerate(names(graph))}
    assert [n for n in graph.blobs if n.startswith("fc6")] == ["fc6", "fc6@relu6", "fc6@drop6"]
    for version, producer, consumer in [("fc6", "fc6", "relu6"), ("fc6@relu6", "relu6", "drop6"),
                                        ("fc6@drop6", "drop6", "fc7")]:
        blob = graph.blobs[version]
        assert blob.base == "fc6" and blob.shape == (10, 4096) and blob.top_index == 0
        assert blob.producer == index[producer]
        assert blob.consumers == [(index[consumer], 0)]
    assert graph.node_of("relu6").bottoms == ["fc6"] and graph.node_of("relu6").tops == ["fc6@relu6"]
    assert graph.node_of("drop6").bottoms == ["fc6@relu6"] and graph.node_of("drop6").tops == ["fc6@drop6"]
    assert graph.node_of("fc7").bottoms == ["fc6@drop6"]
    # every blob version has exactly one producer, and the nodes agree with the blobs
    for i, node in enumerate(graph.nodes):
        for t, top in enumerate(node.tops):
            assert (graph.blobs[top].producer, graph.blobs[top].top_index) == (i, t)
        for b, bottom in enumerate(node.bottoms):
            assert (i, b) in graph.blobs[bottom].consumers


def test_in_place_on_a_blob_already_read_and_on_the_input():
    graph = build_graph(net('''
        layer { name: "relu0" type: "ReLU" bottom: "data" top: "data" }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 4 } }
        layer { name: "keep" type: "Softmax" bottom: "ip" top: "p" }
        layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
        layer { name: "sum" type: "Eltwise" bottom: "ip" bottom: "p" top: "ip" }
    '''), path="inplace.prototxt")
    assert list(graph.blobs) == ["data", "data@relu0", "ip", "p", "ip@relu", "ip@sum"]
    assert graph.node_of("ip").bottoms == ["data@relu0"]
    assert graph.blobs["ip"].consumers == [(3, 0), (4, 0)]           # keep, then relu
    assert graph.node_of("sum").bottoms == ["ip@relu", "p"]
    assert graph.blobs["p"].consumers == [(5, 1)]
    assert graph.outputs() == ["ip@sum"]
    assert graph.blobs["ip@sum"].base == "ip"


# ---- load-time overrides --------------------------------------------------------------------

def test_overrides_on_net_level_input():
    graph = build_graph(str(DEPLOY), "TEST", batch_size=4, input_size=64)
    assert graph.blobs["data"].shape == (4, 3, 64, 64)
    assert (graph.batch_size, graph.input_shape) == (4, (3, 64, 64))
    assert params_of(graph, "fc6")[0][1] == (4096, 3 * 64 * 64)
    assert graph.blobs["prob"].shape == (4, 1000)
    graph = build_graph(str(DEPLOY), "TEST", input_size=(32, 48))
    assert graph.blobs["data"].shape == (10, 3, 32, 48)
    assert build_graph(str(DEPLOY), "TEST", batch_size=1).blobs["data"].shape == (1, 3, 227, 227)


def test_overrides_on_input_layer_with_label():
    text = '''
        layer {
          name: "in" type: "Input" top: "data" top: "label"
          input_param { shape { dim: 8 dim: 3 dim: 10 dim: 10 } shape { dim: 8 } }
        }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 5 } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    '''
    graph = build_graph(text, path="in.prototxt")
    assert (graph.blobs["data"].shape, graph.blobs["label"].shape) == ((8, 3, 10, 10), (8,))
    graph = build_graph(text, batch_size=3, input_size=(6, 7), path="in.prototxt")
    assert (graph.blobs["data"].shape, graph.blobs["label"].shape) == ((3, 3, 6, 7), (3,))
    assert params_of(graph, "ip")[0][1] == (5, 3 * 6 * 7)


@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_overrides_on_data_layers(phase):
    graph = build_graph(str(TRAIN_VAL), phase, batch_size=8, input_size=(96, 128))
    assert graph.blobs["data"].shape == (8, 3, 96, 128) and graph.blobs["label"].shape == (8,)
    assert graph.blobs["fc8"].shape == (8, 1000) and graph.batch_size == 8
    graph = build_graph(str(TRAIN_VAL), phase, batch_size=2)
    assert graph.blobs["data"].shape == (2, 3, 227, 227)
    graph = build_graph(str(LEGACY), phase, input_size=24)
    assert graph.blobs["data"].shape == (64 if phase == "TRAIN" else 100, 3, 24, 24)


def test_input_size_given_at_load_time_for_a_data_layer_without_crop():
    text = '''
        layer { name: "d" type: "Data" top: "data" top: "label" data_param { source: "db" batch_size: 16 } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
    '''
    graph = build_graph(text, input_size=20, path="nocrop.prototxt")
    assert graph.blobs["data"].shape == (16, 3, 20, 20)


# ---- errors: `path:line: message` -----------------------------------------------------------

MARK = "#!"   # marks the line an error must point at


def load_error(tmp_path, text, phase="TRAIN", **kwargs):
    """Write `text` to a file, build it, and return (path, text, the ModelFileError)."""
    text = textwrap.dedent(text).lstrip("\n")
    path = tmp_path / "model.prototxt"
    path.write_text(text)
    with pytest.raises(ModelFileError) as info:
        build_graph(str(path), phase, **kwargs)
    return str(path), text, info.value


def marked_line(text):
    lines = [i for i, line in enumerate(text.splitlines(), 1) if MARK in line]
    assert len(lines) == 1, "a case marks exactly one line"
    return lines[0]


def assert_error(err, path, line, phrase):
    message = str(err)
    assert (err.path, err.line) == (path, line), message
    assert message.startswith(f"{path}:{line}: " if line else f"{path}: "), message
    assert phrase in message, message
    assert "\n" not in message


IP = 'inner_product_param { num_output: 10 }'

ERROR_CASES = {
    "unknown layer type": ('''
        layer {
          name: "fc1"
          type: "FullyConnected"  #!
          bottom: "data"
          top: "fc1"
        }''', "unknown layer type 'FullyConnected' (layer 'fc1')"),
    "an ONNX operator's layer in a Caffe file": ('''
        layer {
          name: "pool1"
          type: "MaxPool"  #!
          bottom: "data"
          top: "pool1"
        }''', "unknown layer type 'MaxPool' (layer 'pool1'): ONNX's operator, read from .onnx files"),
    "current syntax with a legacy type name": ('''
        layer {
          name: "fc1"
          type: "INNER_PRODUCT"  #!
          bottom: "data" top: "fc1"
        }''', "unknown layer type 'INNER_PRODUCT'"),
    "unknown field in a layer": (f'''
        layer {{
          name: "fc1" type: "InnerProduct"
          bottoms: "data"  #!
          top: "fc1" {IP}
        }}''', "unknown field 'bottoms' in LayerParameter"),
    "unknown field in a *_param": ('''
        layer {
          name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param {
            num_output: 10
            weight_filler { type: "gaussian" sdt: 0.01 }  #!
          }
        }''', "unknown field 'sdt' in FillerParameter"),
    "unknown net-level field": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r" }
        inputs: "x"  #!''', "unknown field 'inputs' in NetParameter"),
    "bottom not produced": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{
          name: "cat"
          type: "Concat"
          bottom: "fc1"
          bottom: "fc2"  #!
          top: "cat"
        }}''', "layer 'cat': bottom 'fc2' is not produced by any earlier layer"),
    "bottom produced only later": (f'''
        layer {{ name: "relu" type: "ReLU" bottom: "fc1" top: "r" }}  #!
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}''',
        "bottom 'fc1' is not produced by any earlier layer"),
    "top produced twice": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{
          name: "fc2" type: "InnerProduct" bottom: "data"
          top: "fc1"  #!
          {IP}
        }}''', "layer 'fc2': top 'fc1' is already produced by another layer"),
    "second top produced twice": ('''
        layer { name: "relu" type: "ReLU" bottom: "data" top: "r" }
        layer {
          name: "split" type: "Split" bottom: "data"
          top: "s"
          top: "r"  #!
        }''', "top 'r' is already produced"),
    "top given twice in one layer": ('''
        layer {
          name: "split" type: "Split" bottom: "data"
          top: "s"
          top: "s"  #!
        }''', "layer 'split': top 's' given twice"),
    "duplicate layer name": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{
          name: "fc1"  #!
          type: "ReLU" bottom: "fc1" top: "r"
        }}''', "layer name 'fc1' used twice"),
    "non-repeated field given twice": (f'''
        layer {{
          name: "fc1"
          type: "InnerProduct"
          type: "ReLU"  #!
          bottom: "data" top: "fc1" {IP}
        }}''', "field 'type' given twice in LayerParameter"),
    "non-repeated field given twice in a *_param": ('''
        layer {
          name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: 10
            num_output: 20 }  #!
        }''', "field 'num_output' given twice in InnerProductParameter"),
    "list for a non-repeated field": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: [10, 20] }  #!
        }''', "field 'num_output' in InnerProductParameter is not repeated"),
    "string for an int": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: "10" }  #!
        }''', "field 'num_output' takes an integer, found \"10\""),
    "float for an int": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: 2.5 }  #!
        }''', "field 'num_output' takes an integer, found 2.5"),
    "number for a string": ('''
        layer {
          name: 7  #!
          type: "ReLU" bottom: "data" top: "r" }''', "field 'name' takes a quoted string, found 7"),
    "unquoted string": ('''
        layer { name: "r" type: "ReLU"
          bottom: data  #!
          top: "r" }''', "field 'bottom' takes a quoted string, found data"),
    "bad bool": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: 10 bias_term: yes }  #!
        }''', "field 'bias_term' takes true or false, found yes"),
    "block for a scalar": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param {
            num_output { value: 10 }  #!
          }
        }''', "field 'num_output' takes a value, not a block"),
    "scalar for a block": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: 10
            weight_filler: "gaussian"  #!
          }
        }''', "field 'weight_filler' in InnerProductParameter is a block: write weight_filler { ... }"),
    "scalar for an uninterpreted block": ('''
        layer { name: "py" type: "Python" bottom: "data" top: "p"
          python_param: "my_module"  #!
        }''', "field 'python_param' in LayerParameter is a block"),
    "unknown enum value": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r"
          relu_param { engine: CUDA }  #!
        }''', "field 'engine' takes one of DEFAULT, CAFFE, CUDNN; found CUDA"),
    "enum number out of range": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r"
          include { phase: 2 }  #!
        }''', "field 'phase' takes one of TRAIN, TEST; found 2"),
    "unknown legacy type": ('''
        layers { name: "c" type: CONVOLUTON  #!
          bottom: "data" top: "c" }''', "field 'type' takes one of NONE, ACCURACY"),
    "negative value for a uint": ('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param {
            num_output: -10  #!
          }
        }''', "field 'num_output' cannot be negative, found -10"),
    "stray character": ('''
        layer { name: "r" type: "ReLU" bottom: "data"
          top: "r" $  #!
        }''', "unexpected character '$'"),
    "unterminated string": ('''
        layer {
          name: "relu1  #!
          type: "ReLU" bottom: "data" top: "r"
        }''', "unterminated string"),
    "unmatched closing brace": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r" }
        }  #!''', "'}' does not close any block"),
    "missing field value": ('''
        layer { name: "r" type: "ReLU" bottom: "data"
          top: }  #!''', "field 'top' has no value"),
    "num_output missing": ('''
        layer {  #!
          name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { bias_term: false }
        }''', "layer 'fc1' (InnerProduct): num_output is required"),
    "shape that does not fit": ('''
        layer {  #!
          name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param { num_output: 10 axis: 4 }
        }''', "axis 4 out of range for input shape (2, 3, 4, 4)"),
    "concat of mismatched shapes": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{ name: "flat" type: "Flatten" bottom: "data" top: "flat" }}
        layer {{ name: "cat" type: "Concat" bottom: "flat" bottom: "fc1" top: "cat" concat_param {{ axis: 0 }} }}  #!''',
        "differ outside axis 0"),
    "eltwise of mismatched shapes": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{ name: "fc2" type: "InnerProduct" bottom: "data" top: "fc2" inner_product_param {{ num_output: 11 }} }}
        layer {{ name: "sum" type: "Eltwise" bottom: "fc1" bottom: "fc2" top: "sum" }}  #!''',
        "bottom shapes differ"),
    "wrong bottom count": ('''
        layer { name: "r" type: "ReLU" bottom: "data" bottom: "data" top: "r" }  #!''',
        "layer 'r' (ReLU) takes 1 bottom(s), got 2"),
    "no top": ('''
        layer { name: "r" type: "ReLU" bottom: "data" }  #!''', "gives 1 top(s), got 0"),
    "layer without a type": ('''
        layer { name: "r" bottom: "data" top: "r" }  #!''', "layer 'r' has no type"),
    "layer without a name": ('''
        layer { type: "ReLU" bottom: "data" top: "r" }  #!''', "layer has no name"),
    "loss_weight on a non-scalar top": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP}
          loss_weight: 1 }}  #!''', "loss_weight on top 'fc1' which is not a scalar"),
    "propagate_down count mismatch": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r"
          propagate_down: false  #!
          propagate_down: true }''', "has 2 propagate_down values for 1 bottom(s)"),
    "include and exclude together": ('''
        layer { name: "r" type: "ReLU" bottom: "data" top: "r"
          include { phase: TRAIN }
          exclude { phase: TEST }  #!
        }''', "give include rules or exclude rules, not both"),
    "shared parameters": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP}
          param {{ name: "w" lr_mult: 1 }}  #!
        }}''', "shared parameters"),
    "legacy shared parameters": (f'''
        layers {{ name: "fc1" type: INNER_PRODUCT bottom: "data" top: "fc1" {IP}
          param: "w"  #!
        }}''', "shared parameters"),
    "legacy V0 layer": ('''
        layers {  #!
          layer { name: "fc1" type: "innerproduct" }
          bottom: "data" top: "fc1"
        }''', "V0 layer format"),
    "mixing layer and layers": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layers {{ name: "relu" type: RELU bottom: "fc1" top: "fc1" }}  #!
        layer {{ name: "prob" type: "Softmax" bottom: "fc1" top: "prob" }}''',
        "mixes the 'layer' and legacy 'layers' syntax"),
    "data layer without a size": ('''
        layer {  #!
          name: "d" type: "Data" top: "x" top: "y"
          data_param { source: "db" batch_size: 8 }
        }''', "no input height/width"),
    "data layer without a batch size": ('''
        layer {  #!
          name: "d" type: "Data" top: "x"
          transform_param { crop_size: 32 }
          data_param { source: "db" }
        }''', "no batch size"),
}

# cases that need a label blob: net-level inputs data (2, 3, 4, 4) and label (2,)
LABEL_HEAD = '''name: "t"
input: "data"
input_shape { dim: 2 dim: 3 dim: 4 dim: 4 }
input: "label"
input_shape { dim: 2 }
'''
LABEL_CASES = {
    "loss_weight count mismatch": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc1" bottom: "label"
          top: "loss" top: "prob"
          loss_weight: 1  #!
        }}''', "layer 'loss' has 1 loss_weight values for 2 top(s)"),
    "too many loss_weight values": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc1" bottom: "label" top: "loss"
          loss_weight: 1  #!
          loss_weight: 0.5
        }}''', "has 2 loss_weight values for 1 top(s)"),
    "accuracy top_k above the class count": (f'''
        layer {{ name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" {IP} }}
        layer {{ name: "acc" type: "Accuracy" bottom: "fc1" bottom: "label" top: "acc"  #!
          accuracy_param {{ top_k: 11 }} }}''', "top_k must be in [1, 10]"),
    "label count mismatch": ('''
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "data" bottom: "label" top: "loss" }  #!''',
        "label count 2 does not match 32 predictions"),
}
ALL_CASES = {**{name: (HEAD, body, phrase) for name, (body, phrase) in ERROR_CASES.items()},
             **{name: (LABEL_HEAD, body, phrase) for name, (body, phrase) in LABEL_CASES.items()}}


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_error_names_file_and_line(tmp_path, case):
    head, body, phrase = ALL_CASES[case]
    path, text, err = load_error(tmp_path, head + textwrap.dedent(body).lstrip("\n"))
    assert_error(err, path, marked_line(text), phrase)


def test_error_in_text_source_names_the_given_path():
    with pytest.raises(ModelFileError) as info:
        build_graph(net('layer { name: "r" type: "ReLUU" bottom: "data" top: "r" }'), path="inline.prototxt")
    assert_error(info.value, "inline.prototxt", 4, "unknown layer type 'ReLUU'")


def test_unterminated_block_reports_where_it_opened(tmp_path):
    path, text, err = load_error(tmp_path, net('''
        layer {  #!
          name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param {
            num_output: 10
          }

        # the layer's closing brace is missing
    '''))
    opened = marked_line(text)
    assert_error(err, path, opened + 4, f"missing '}}' at the end of the file for the block opened on line {opened}")


def test_unterminated_nested_block_and_list(tmp_path):
    path, text, err = load_error(tmp_path, net('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param <  #!
            num_output: 10
        }
    '''))
    opened = marked_line(text)
    assert_error(err, path, opened + 2, f"'}}' cannot close the block opened on line {opened} with '<'")
    path, text, err = load_error(tmp_path, net('''
        layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1"
          inner_product_param <  #!
            num_output: 10
    '''))
    opened = marked_line(text)
    assert_error(err, path, opened + 1, f"missing '>' at the end of the file for the block opened on line {opened}")
    path, text, err = load_error(tmp_path, '''
        input: "data"
        input_shape { dim: [2, 3,  #!
    ''')
    assert_error(err, path, 2, "missing ']' at the end of the file for the list opened on line 2")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", 'name: "empty"\n'])
def test_empty_file(tmp_path, text):
    path, _, err = load_error(tmp_path, text)
    assert_error(err, path, 0, "no layers in phase TRAIN")


def test_no_layers_in_phase(tmp_path):
    text = '''
        layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } include { phase: TEST } }
    '''
    path, _, err = load_error(tmp_path, text, "TRAIN")
    assert_error(err, path, 0, "no layers in phase TRAIN")
    graph = build_graph(path, "TEST")
    assert names(graph) == ["in"]


def test_model_file_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "no" / "such.prototxt")
    with pytest.raises(ModelFileError) as info:
        build_graph(missing)
    assert info.value.line == 0 and info.value.path == missing
    assert str(info.value) == f"{missing}: model file not found"
    with pytest.raises(ModelFileError, match="cannot read model file"):
        build_graph(str(tmp_path))          # a directory


@pytest.mark.parametrize("text, line, phrase", [
    ('input: "data"\ninput_dim: 10\ninput_dim: 3\ninput_dim: 227\n', 2,
     "1 input(s) need 4 input_dim values, got 3"),
    ('input: "data"\ninput_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8\ninput: "label"\ninput_dim: 1\n', 2,
     "2 input(s) need 8 input_dim values, got 5"),
    ('input: "data"\ninput: "label"\ninput_shape { dim: 1 dim: 3 }\n', 1,
     "each 'input' needs an input_shape or 4 input_dim values"),
    ('name: "n"\ninput: "data"\n', 2, "each 'input' needs an input_shape or 4 input_dim values"),
    ('name: "n"\ninput_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8\n', 2,
     "'input_dim' given without a net-level 'input'"),
    ('input_shape { dim: 1 dim: 3 }\nlayer { name: "r" type: "ReLU" bottom: "x" top: "x" }\n', 1,
     "'input_shape' given without a net-level 'input'"),
])
def test_net_level_input_errors(tmp_path, text, line, phrase):
    path, _, err = load_error(tmp_path, text)
    assert_error(err, path, line, phrase)


def test_error_cases_cover_the_required_kinds():
    """The issue's list of errors, each with at least one case above."""
    required = ["unknown layer type", "unknown field in a layer", "unknown field in a *_param",
                "bottom not produced", "top produced twice", "duplicate layer name",
                "non-repeated field given twice", "string for an int", "block for a scalar",
                "unknown enum value", "stray character", "unterminated string",
                "num_output missing", "concat of mismatched shapes", "loss_weight count mismatch",
                "negative value for a uint", "mixing layer and layers"]
    assert set(required) <= set(ALL_CASES) and len(ALL_CASES) >= 40


# ---- Caffe model files as Caffe means them -------------------------------------------------

NIN_TAIL = DATA / "nin_legacy_tail.prototxt"
TINY_DEPLOY = DATA / "tiny_deploy.prototxt"
PHASE_EXCLUDED = DATA / "phase_excluded.prototxt"
DENSENET_POOL = DATA / "densenet_pool.prototxt"


def test_legacy_loss_layer_without_top_gets_one_with_loss_weight_1():
    graph = build_graph(NIN_TAIL)
    loss = graph.node_of("loss")
    assert loss.layer.type == "SoftmaxWithLoss"
    assert loss.tops == ["loss"] and graph.blobs["loss"].shape == ()
    assert graph.loss_weights == {"loss": 1.0}
    assert graph.outputs() == ["loss"]


def test_loss_layer_without_top_in_the_new_syntax_and_a_name_taken_by_a_blob():
    body = '''
        layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
        layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } }
        layer { name: "fc_loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" }
        layer { name: "fc" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" loss_weight: 0.5 }
    '''
    with pytest.raises(ModelFileError, match="layer name 'fc' used twice"):
        build_graph(net(body), path="t.prototxt")
    graph = build_graph(net(body.replace('name: "fc" type: "SoftmaxWithLoss"', 'name: "label" type: "SoftmaxWithLoss"')
                            .replace('name: "label" type: "Input"', 'name: "labels" type: "Input"')),
                        path="t.prototxt")
    # the second loss layer is named like the blob "label": its automatic top is "label_1"
    assert graph.node_of("fc_loss").tops == ["fc_loss"]
    assert graph.loss_weights == {"fc_loss": 1.0, "label_1": 0.5}


def test_accuracy_is_not_a_loss_layer_and_still_needs_its_top():
    body = '''
        layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
        layer { name: "acc" type: "Accuracy" bottom: "data" bottom: "label" }
    '''
    with pytest.raises(ModelFileError, match=r"t.prototxt:5: .*'acc' \(Accuracy\) gives 1 to 2 top\(s\), got 0"):
        build_graph(net(body), path="t.prototxt")


def test_phase_excluded_producer_is_named_in_the_error():
    build_graph(PHASE_EXCLUDED, "TRAIN")
    with pytest.raises(ModelFileError) as error:
        build_graph(PHASE_EXCLUDED, "TEST")
    assert str(error.value) == (f"{PHASE_EXCLUDED}:19: layer 'accuracy': bottom 'scores' comes only from layer "
                                f"'fc' (line 10), which its include rule leaves out of the TEST phase")
    excluded = PHASE_EXCLUDED.read_text().replace("include { phase: TRAIN }\n}", "exclude { phase: TEST }\n}")
    with pytest.raises(ModelFileError, match="which its exclude rule leaves out of the TEST phase"):
        build_graph(excluded, "TEST", path="p.prototxt")
    # a bottom nobody writes at all keeps the plain message
    with pytest.raises(ModelFileError, match="bottom 'nowhere' is not produced by any earlier layer"):
        build_graph(net('layer { name: "r" type: "ReLU" bottom: "nowhere" top: "r" }'), path="t.prototxt")


def test_ceil_mode_is_the_forks_spelling_of_round_mode():
    graph = build_graph(DENSENET_POOL)
    assert graph.node_of("pool_floor").layer.round_mode == "FLOOR"
    assert graph.node_of("pool_ceil").layer.round_mode == "CEIL"
    # 7 -> floor((7 - 2) / 2) + 1 = 3 and ceil(...) + 1 = 4, as round_mode FLOOR and CEIL give
    assert graph.blobs["pool_floor"].shape == (1, 2, 3, 3)
    assert graph.blobs["pool_ceil"].shape == (1, 2, 4, 4)
    text = DENSENET_POOL.read_text()
    agreeing = text.replace("ceil_mode: false", "ceil_mode: false round_mode: FLOOR")
    assert build_graph(agreeing, path="d.prototxt").blobs["pool_floor"].shape == (1, 2, 3, 3)
    conflicting = text.replace("ceil_mode: true }", "ceil_mode: true\n    round_mode: FLOOR }")
    with pytest.raises(ModelFileError) as error:
        build_graph(conflicting, path="d.prototxt")
    assert str(error.value).startswith("d.prototxt:18: layer 'pool_ceil' (Pooling): ceil_mode: true means "
                                       "round_mode CEIL, but round_mode FLOOR is given (line 19)")


def test_add_loss_puts_a_softmax_loss_on_the_scores_of_the_final_softmax():
    train = build_graph(TINY_DEPLOY, "TRAIN", add_loss=True)
    assert names(train) == ["input", "conv1", "relu1", "fc", "label", "loss"]
    loss = train.node_of("loss")
    assert loss.layer.type == "SoftmaxWithLoss" and loss.bottoms == ["fc", "label"]
    assert train.blobs["label"].shape == (4,) and train.loss_weights == {"loss": 1.0}
    assert "'fc', the scores that feed the final Softmax 'prob'" in train.added_loss
    test = build_graph(TINY_DEPLOY, "TEST", add_loss=True)
    assert names(test) == ["input", "conv1", "relu1", "fc", "prob", "label", "loss", "accuracy"]
    assert test.node_of("accuracy").bottoms == ["fc", "label"]
    assert sorted(test.outputs()) == ["accuracy", "loss", "prob"]
    assert test.added_loss.endswith("and an Accuracy 'accuracy'")
    # the data feeding sees (data, label), like a train_val file's data layer
    assert [top for node in train.nodes if node.layer.is_data for top in node.tops] == ["data", "label"]
    assert build_graph(TINY_DEPLOY, "TRAIN", batch_size=7, add_loss=True).blobs["label"].shape == (7,)
    plain = build_graph(TINY_DEPLOY)
    assert plain.loss_weights == {} and plain.added_loss == ""


def test_add_loss_without_a_final_softmax_and_on_a_file_that_has_a_loss():
    no_softmax = TINY_DEPLOY.read_text().replace('layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }', "")
    graph = build_graph(no_softmax, add_loss=True, path="d.prototxt")
    assert graph.node_of("loss").bottoms == ["fc", "label"]
    assert "'fc', the output of the last layer 'fc'" in graph.added_loss
    with pytest.raises(ModelFileError, match="--add-loss: the model already has a loss layer 'loss'"):
        build_graph(NIN_TAIL, add_loss=True)


def test_add_loss_feeds_the_label_of_a_data_layer_that_has_one():
    text = NIN_TAIL.read_text().split("layers {\n  name: \"loss\"")[0]
    graph = build_graph(text, add_loss=True, path="n.prototxt")
    assert names(graph) == ["data", "cccp8", "relu_cccp8", "pool4", "loss"]
    assert graph.node_of("loss").bottoms == ["pool4", "label"]
    assert graph.added_loss == ("SoftmaxWithLoss 'loss' on 'pool4', the output of the last layer 'pool4', "
                                "with the label 'label' of the data layer")


@pytest.mark.parametrize("text, line", [("dim 3", 1), ("dim: 1\ndim [4]", 2), ("dim []", 1)])
def test_a_value_that_is_no_block_needs_its_colon_as_in_protobuf(text, line):
    """protobuf's text parser (and so Caffe) requires `name: value` unless the value is a
    block; a file that Caffe cannot read is refused here too, at its line."""
    with pytest.raises(ModelFileError, match=r"field 'dim' needs a ':' before its value") as info:
        parse(text, root="BlobShape")
    assert info.value.line == line


def test_an_opaque_messages_scalars_need_their_colon_too():
    with pytest.raises(ModelFileError, match="field 'module' needs a ':'"):
        parse('name: "py" type: "Python" python_param { module "my_layers" }', root="LayerParameter")
