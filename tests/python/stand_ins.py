"""Stages that carry only a pipeline's shape, as PyTorch's test_schedule.py builds them
(MockPipelineStage): what a schedule's constructor reads to plan, no module. For the tests that
look at plans of torch's classes and of zbpp's."""


def stand_in_class(base):
    """A subclass of `base` (torch's or zbpp's _PipelineStageBase) that skips its constructor."""

    class StandIn(base):
        def __init__(self, num_stages, group_size, group_rank=0, stage_index=None):  # noqa: D107 - no super()
            self.submod, self.group = None, None
            self.num_stages, self.group_size, self.group_rank = num_stages, group_size, group_rank
            if stage_index is not None:
                self.stage_index = stage_index

        def _create_grad_recv_info(self, *args, **kwargs):
            return None

        def _prepare_forward_infra(self, n_microbatches):
            pass

        def _prepare_backward_infra(self, n_microbatches):
            pass

    return StandIn
