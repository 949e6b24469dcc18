"""The optimizer's measured cost model (minigist/costmodel.py): a step that runs in place is
keyed apart from the same step out of place and predicted from whichever form was profiled;
steps nobody profiled take the FLOP model scaled by the profiled steps of their own kind
(GEMM or not)."""
import pytest

from minigist.costmodel import IN_PLACE, FlopModel, MeasuredModel, runs_in_place, signature, step_flops
from minigist.pipeline import Options, compile
from minigist.program import Step
from test_gist import model

FALLBACK = FlopModel(50e9, 20e9)


@pytest.fixture(scope="module")
def program():
    return compile(model("resnet20"), Options(batch_size=2)).program


def forward(program, layer_type, in_place):
    return next(s for s in program.steps if s.kind == "forward" and s.layer.type == layer_type
                and runs_in_place(s, program) == in_place)


def output_seconds(step, program):
    return sum(program.buffers[name].nbytes for name in step.args["y"]) / FALLBACK.bandwidth


def test_a_step_in_place_is_keyed_apart_from_its_replay(program):
    relu = forward(program, "ReLU", in_place=True)
    key = signature(relu, program)
    assert key[-1] == IN_PLACE and signature(relu) == key[:-1]
    replay = Step("recompute", relu.layer, relu.args)       # a replay writes a copy of its own
    assert signature(replay, program) == ("recompute",) + key[1:-1]
    conv = forward(program, "Convolution", in_place=False)
    assert signature(conv, program) == signature(conv)


def test_a_replay_of_a_step_profiled_in_place_adds_its_output_traffic(program):
    relu = forward(program, "ReLU", in_place=True)
    measured = MeasuredModel({signature(relu, program): 1e-3}, FALLBACK, 1)
    replay = Step("recompute", relu.layer, relu.args)
    assert measured.step_seconds(relu, program) == 1e-3
    assert measured.step_seconds(replay, program) == pytest.approx(1e-3 + output_seconds(relu, program))


def test_a_step_in_place_profiled_out_of_place_saves_its_output_traffic_at_most_half(program):
    relu = forward(program, "ReLU", in_place=True)
    output = output_seconds(relu, program)
    for profiled in (10 * output, 1.5 * output):
        measured = MeasuredModel({signature(relu): profiled}, FALLBACK, 1)
        assert measured.step_seconds(relu, program) == pytest.approx(max(profiled - output, profiled / 2))


def test_steps_not_profiled_scale_by_the_profiled_steps_of_their_kind(program):
    conv = forward(program, "Convolution", in_place=False)
    relu = forward(program, "ReLU", in_place=True)
    assert step_flops(conv) > 0 and step_flops(relu) == 0
    measured = MeasuredModel({signature(conv, program): 8 * FALLBACK.step_seconds(conv, program),
                              signature(relu, program): 2 * FALLBACK.step_seconds(relu, program)}, FALLBACK, 1)
    measured.calibrate([program])
    assert measured.gemm_scale == pytest.approx(8) and measured.bytes_scale == pytest.approx(2)
    other_conv = next(s for s in program.steps if s.kind == "backward" and s.layer.type == "Convolution")
    batchnorm = next(s for s in program.steps if s.kind == "backward" and s.layer.type == "BatchNorm")
    assert measured.step_seconds(other_conv, program) == pytest.approx(8 * FALLBACK.step_seconds(other_conv, program))
    assert measured.step_seconds(batchnorm, program) == pytest.approx(2 * FALLBACK.step_seconds(batchnorm, program))
    assert measured.bytes_seconds(1 << 20) == pytest.approx(2 * FALLBACK.bytes_seconds(1 << 20))
