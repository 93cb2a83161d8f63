// RUN: hspmd-opt %s -p lower-reshard --split-input-file | filecheck %s

// Each physical dist.reshard becomes the comm ops of its plan, over explicit rank groups,
// with local shapes: partial->dup is an all_reduce (same shape), split->dup an all_gather
// (the split dim grows by the group size), dup->split a local_split (it shrinks),
// split(0)->split(1) an all_to_all, partial->split a reduce_scatter. Uses of the reshard
// now use the last comm op's result.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2">>} : tensor<4x4xf32>
      %p = graph.reduce_sum %x {dims = array<i64: 0>} : (tensor<4x4xf32>) -> tensor<4xf32>
      %a = dist.reshard %p {src = #dist.layout<"[0,1]: partial=2">, dst = #dist.layout<"[0,1]: dup=2">} : tensor<4xf32> -> tensor<4xf32>
      %g = dist.reshard %x {src = #dist.layout<"[0,1]: split(0)=2">, dst = #dist.layout<"[0,1]: dup=2">} : tensor<4x4xf32> -> tensor<8x4xf32>
      %s = dist.reshard %g {src = #dist.layout<"[0,1]: dup=2">, dst = #dist.layout<"[0,1]: split(1)=2">} : tensor<8x4xf32> -> tensor<8x2xf32>
      %t = dist.reshard %x {src = #dist.layout<"[0,1]: split(0)=2">, dst = #dist.layout<"[0,1]: split(1)=2">} : tensor<4x4xf32> -> tensor<8x2xf32>
      %r = dist.reshard %p {src = #dist.layout<"[0,1]: partial=2">, dst = #dist.layout<"[0,1]: split(0)=2">} : tensor<4xf32> -> tensor<2xf32>
      graph.output "a", %a : tensor<4xf32>
      %st = graph.add %s, %t : (tensor<8x2xf32>, tensor<8x2xf32>) -> tensor<8x2xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">}
// CHECK-NOT:     dist.reshard
// CHECK:         %p = graph.reduce_sum
// CHECK-NEXT:    [[A:%.*]] = comm.all_reduce %p {groups = #dist.groups<"{0,1}">} : tensor<4xf32> -> tensor<4xf32>
// CHECK-NEXT:    [[G:%.*]] = comm.all_gather %x {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<4x4xf32> -> tensor<8x4xf32>
// CHECK-NEXT:    [[S:%.*]] = comm.local_split [[G]] {groups = #dist.groups<"{0,1}">, dim = 1 : i64} : tensor<8x4xf32> -> tensor<8x2xf32>
// CHECK-NEXT:    [[T:%.*]] = comm.all_to_all %x {groups = #dist.groups<"{0,1}">, split_dim = 1 : i64, concat_dim = 0 : i64} : tensor<4x4xf32> -> tensor<8x2xf32>
// CHECK-NEXT:    {{%.*}} = comm.reduce_scatter %p {groups = #dist.groups<"{0,1}">, dim = 0 : i64} : tensor<4xf32> -> tensor<2xf32>
// CHECK-NEXT:    graph.output "a", [[A]] : tensor<4xf32>
// CHECK-NEXT:    %st = graph.add [[S]], [[T]] : (tensor<8x2xf32>, tensor<8x2xf32>) -> tensor<8x2xf32>
// CHECK-NEXT:    func.return

// -----

// On a 2x2 mesh one reshard can take two steps, each over the rank groups of one mesh axis
// (ranks 0,1 | 2,3 share the inner axis, ranks 0,2 | 1,3 the outer one).

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
    func.func @train_step() {
      %w = graph.parameter "w" {init = "zeros", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<8x6xf32>
      %ws = dist.reshard %w {src = #dist.layout<"[0-3]: dup=4">, dst = #dist.layout<"[0-3]: split(0)=2, split(1)=2">} : tensor<8x6xf32> -> tensor<4x3xf32>
      %r = graph.reduce_sum %ws {dims = array<i64: 1>} : (tensor<4x3xf32>) -> tensor<4xf32>
      %d = dist.reshard %r {src = #dist.layout<"[0-3]: split(0)=2, partial=2">, dst = #dist.layout<"[0-3]: dup=4">} : tensor<4xf32> -> tensor<8xf32>
      graph.output "r", %d : tensor<8xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">}
// CHECK:         %w = graph.parameter "w"
// CHECK-NEXT:    [[W0:%.*]] = comm.local_split %w {groups = #dist.groups<"{0,2},{1,3}">, dim = 0 : i64} : tensor<8x6xf32> -> tensor<4x6xf32>
// CHECK-NEXT:    [[W1:%.*]] = comm.local_split [[W0]] {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<4x6xf32> -> tensor<4x3xf32>
// CHECK-NEXT:    %r = graph.reduce_sum [[W1]] {dims = array<i64: 1>} : (tensor<4x3xf32>) -> tensor<4xf32>
// CHECK-NEXT:    [[R0:%.*]] = comm.all_reduce %r {groups = #dist.groups<"[2,2]<=[4]">} : tensor<4xf32> -> tensor<4xf32>
// CHECK-NEXT:    [[R1:%.*]] = comm.all_gather [[R0]] {groups = #dist.groups<"{0,2},{1,3}">, dim = 0 : i64} : tensor<4xf32> -> tensor<8xf32>
// CHECK-NEXT:    graph.output "r", [[R1]] : tensor<8xf32>
// CHECK-NOT:     dist.reshard
