// RUN: hspmd-opt %s -p lower-reshard | filecheck %s

// Reshards across the groups of a heterogeneous union: in each group's module, the steps
// that involve its devices. Partial sums per group (hetero=partial) -> replicated: zero the
// replicas inside a group ([0,1] dup=2, so only in group0's module), then one flat all_reduce
// over every device. Batch rows split 3:1 across groups -> replicated: one all_gather over
// every device in slice order; the members' extents differ (6, 6 and 4 rows), so it carries
// `sizes` and its result (16 rows) is the same on every rank.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<16x4xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1">>} : tensor<6x4xf32>
      %p = graph.reduce_sum %x {dims = array<i64: 0>} : (tensor<6x4xf32>) -> tensor<4xf32>
      %a = dist.reshard %p {src = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=partial">, dst = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">} : tensor<4xf32> -> tensor<4xf32>
      %g = dist.reshard %x {src = #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1">, dst = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">} : tensor<6x4xf32> -> tensor<16x4xf32>
      graph.output "a", %a : tensor<4xf32>
      graph.output "g", %g : tensor<16x4xf32>
      func.return
    }
  }
  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2">} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<16x4xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1">>} : tensor<4x4xf32>
      %p = graph.reduce_sum %x {dims = array<i64: 0>} : (tensor<4x4xf32>) -> tensor<4xf32>
      %a = dist.reshard %p {src = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=partial">, dst = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">} : tensor<4xf32> -> tensor<4xf32>
      %g = dist.reshard %x {src = #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1">, dst = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">} : tensor<4x4xf32> -> tensor<16x4xf32>
      graph.output "a", %a : tensor<4xf32>
      graph.output "g", %g : tensor<16x4xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0
// CHECK:         [[Z:%.*]] = comm.local_zero %p {groups = #dist.groups<"{0,1}">} : tensor<4xf32> -> tensor<4xf32>
// CHECK-NEXT:    [[A:%.*]] = comm.all_reduce [[Z]] {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
// CHECK-NEXT:    [[G:%.*]] = comm.all_gather %x {groups = #dist.groups<"{0-2}">, dim = 0 : i64, sizes = array<i64: 6, 6, 4>} : tensor<6x4xf32> -> tensor<16x4xf32>
// CHECK-NEXT:    graph.output "a", [[A]] : tensor<4xf32>
// CHECK-LABEL: builtin.module @group1
// CHECK-NOT:     comm.local_zero
// CHECK:         [[A1:%.*]] = comm.all_reduce %p {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
// CHECK-NEXT:    [[G1:%.*]] = comm.all_gather %x {groups = #dist.groups<"{0-2}">, dim = 0 : i64, sizes = array<i64: 6, 6, 4>} : tensor<4x4xf32> -> tensor<16x4xf32>
// CHECK-NEXT:    graph.output "a", [[A1]] : tensor<4xf32>
