"""Step fitting (paxkv.scheduling.step_fitting) through the ReplicaScheduler: a step just past a step size gives
its excess prefill tokens to a later step, where that saves padding."""

from test_replica_scheduler import FakeModel, make_request, make_scheduler, run_alone, run_step

from paxkv.execution.step_inputs import StepPadding, power_of_two_buckets


def scheduler_of_512_tokens(step_sizes, num_pages=128):
    """A scheduler with a budget of 512 tokens a step over pages of 16 tokens, fitting steps to `step_sizes`."""
    return make_scheduler(
        num_pages=num_pages, page_size=16, max_num_batched_tokens=512, max_model_len=1024, step_sizes=step_sizes
    )


def test_a_step_just_past_a_step_size_is_trimmed_to_it():
    """300 prompt tokens would pad to 512: they run as 256 and then 44, the request holding only the pages of its
    first chunk in between, and the output is the untrimmed one."""
    scheduler = scheduler_of_512_tokens(power_of_two_buckets(512))
    request = make_request("p", 300, max_tokens=3, ignore_eos=True)
    scheduler.add_request(request)
    model = FakeModel()
    batch, _ = run_step(scheduler, model)
    assert batch.num_batched_tokens == 256 and not batch.sequences[0].completes_prompt
    assert len(request.block_table) == 16 and scheduler.allocator.num_free_pages == 127 - 16
    batch, _ = run_step(scheduler, model)
    assert batch.num_batched_tokens == 44 and batch.sequences[0].completes_prompt
    while scheduler.has_unfinished_requests():
        run_step(scheduler, model)
    assert (request.output_token_ids, request.finish_reason) == run_alone("p", 300, max_tokens=3, ignore_eos=True)


def test_steps_fit_to_the_half_steps_only_where_a_whole_step_of_padding_is_saved():
    """With the runner's sizes (powers of two and 1.5 times them from 96 up): 100 tokens run as one step of 128, not
    96 + 4 (32 tokens of padding saved do not pay for a step of their own); 260 as 256 + 4 (128 saved); 300 as one
    step of 384 (44 tokens past 256 are more than a quarter of the gap)."""
    for num_tokens, steps in ((100, [100]), (260, [256, 4]), (300, [300])):
        scheduler = scheduler_of_512_tokens(StepPadding().token_buckets(512))
        scheduler.add_request(make_request("p", num_tokens, max_tokens=1))
        model, sizes = FakeModel(), []
        while scheduler.has_unfinished_requests():
            batch, _ = run_step(scheduler, model)
            sizes.append(batch.num_batched_tokens)
        assert sizes == steps, num_tokens


def test_the_newest_chunks_give_up_the_tokens_and_decodes_keep_theirs():
    """Three decodes and two new prompts (3 + 100 + 40 = 143 tokens) run as 128: the newest prompt gives up its
    tokens but one; a step too far past a size (here 324 of 512), or below MIN_FITTED_STEP_SIZE, is left alone."""
    scheduler = scheduler_of_512_tokens(power_of_two_buckets(512), num_pages=256)
    model = FakeModel()
    for index in range(3):
        scheduler.add_request(make_request(f"d{index}", 4, max_tokens=20, ignore_eos=True))
    run_step(scheduler, model)
    scheduler.add_request(make_request("a", 100, max_tokens=1))
    scheduler.add_request(make_request("b", 40, max_tokens=1))
    batch, _ = run_step(scheduler, model)
    assert [(s.request.request_id, s.num_new_tokens) for s in batch.sequences] == [
        ("d0", 1), ("d1", 1), ("d2", 1), ("a", 100), ("b", 25)
    ]  # fmt: skip
    assert batch.num_batched_tokens == 128
    scheduler.add_request(make_request("c", 321, max_tokens=1))
    batch, _ = run_step(scheduler, model)  # d0-d2, the rest of b (15) and c: 339 tokens, over 256 + 64
    assert batch.num_batched_tokens == 3 + 15 + 321

    small = make_scheduler(num_pages=64, page_size=4, max_num_batched_tokens=64, step_sizes=power_of_two_buckets(64))
    small.add_request(make_request("s", 36, max_tokens=1))  # 36 would pad to 64, but 32 is below the minimum
    assert small.schedule().num_batched_tokens == 36
