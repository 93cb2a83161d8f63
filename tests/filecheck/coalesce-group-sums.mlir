// RUN: hspmd-opt %s -p coalesce-group-sums | filecheck %s

// Sums across the device groups of a heterogeneous union, marked where every program may make
// them one bucket. The loss's sum and the sums of %a and %b are run 0 (the loss is read only
// as an output; the all-reduce over [0,1] between them stays inside group0's module, whose own
// ranks meet it in one order). %c's operand reads run 0's results, so it starts run 1, which
// %d joins. The all_gather across the groups ends run 1, and %e after it is alone: not marked.
// Group1's module has the same sums in the same order and gets the same marks.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<12xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=2:1">>} : tensor<4xf32>
      %l = graph.reduce_sum %x {dims = array<i64: 0>} : (tensor<4xf32>) -> tensor<f32>
      %L = comm.all_reduce %l {groups = #dist.groups<"{0-2}">} : tensor<f32> -> tensor<f32>
      graph.output "loss", %L : tensor<f32>
      %a = graph.scale %x {factor = 2.000000e+00 : f64} : (tensor<4xf32>) -> tensor<4xf32>
      %b = graph.scale %x {factor = 3.000000e+00 : f64} : (tensor<4xf32>) -> tensor<4xf32>
      %A = comm.all_reduce %a {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %i = comm.all_reduce %a {groups = #dist.groups<"{0,1}">} : tensor<4xf32> -> tensor<4xf32>
      %B = comm.all_reduce %b {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %s = graph.add %A, %B : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
      %C = comm.all_reduce %s {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %D = comm.all_reduce %b {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %G = comm.all_gather %x {groups = #dist.groups<"{0-2}">, dim = 0 : i64, sizes = array<i64: 4, 4, 4>} : tensor<4xf32> -> tensor<12xf32>
      %E = comm.all_reduce %a {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      graph.output "i", %i : tensor<4xf32>
      graph.output "c", %C : tensor<4xf32>
      graph.output "d", %D : tensor<4xf32>
      graph.output "g", %G : tensor<12xf32>
      graph.output "e", %E : tensor<4xf32>
      func.return
    }
  }
  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2">} {
    func.func @train_step() {
      %x = graph.input "x" {global_type = tensor<12xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=2:1">>} : tensor<4xf32>
      %l = graph.reduce_sum %x {dims = array<i64: 0>} : (tensor<4xf32>) -> tensor<f32>
      %L = comm.all_reduce %l {groups = #dist.groups<"{0-2}">} : tensor<f32> -> tensor<f32>
      graph.output "loss", %L : tensor<f32>
      %a = graph.scale %x {factor = 2.000000e+00 : f64} : (tensor<4xf32>) -> tensor<4xf32>
      %b = graph.scale %x {factor = 3.000000e+00 : f64} : (tensor<4xf32>) -> tensor<4xf32>
      %A = comm.all_reduce %a {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %B = comm.all_reduce %b {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %s = graph.add %A, %B : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
      %C = comm.all_reduce %s {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %D = comm.all_reduce %b {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      %G = comm.all_gather %x {groups = #dist.groups<"{0-2}">, dim = 0 : i64, sizes = array<i64: 4, 4, 4>} : tensor<4xf32> -> tensor<12xf32>
      %E = comm.all_reduce %a {groups = #dist.groups<"{0-2}">} : tensor<4xf32> -> tensor<4xf32>
      graph.output "c", %C : tensor<4xf32>
      graph.output "d", %D : tensor<4xf32>
      graph.output "g", %G : tensor<12xf32>
      graph.output "e", %E : tensor<4xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0
// CHECK:         %L = comm.all_reduce %l {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK:         %A = comm.all_reduce %a {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %i = comm.all_reduce %a {groups = #dist.groups<"{0,1}">}
// CHECK-NEXT:    %B = comm.all_reduce %b {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK:         %C = comm.all_reduce %s {coalesce = 1 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %D = comm.all_reduce %b {coalesce = 1 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %G = comm.all_gather %x {groups = #dist.groups<"{0-2}">, dim = 0 : i64
// CHECK-NEXT:    %E = comm.all_reduce %a {groups = #dist.groups<"{0-2}">}
// CHECK-LABEL: builtin.module @group1
// CHECK:         %L = comm.all_reduce %l {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK:         %A = comm.all_reduce %a {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %B = comm.all_reduce %b {coalesce = 0 : i64, groups = #dist.groups<"{0-2}">}
// CHECK:         %C = comm.all_reduce %s {coalesce = 1 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %D = comm.all_reduce %b {coalesce = 1 : i64, groups = #dist.groups<"{0-2}">}
// CHECK-NEXT:    %G = comm.all_gather
// CHECK-NEXT:    %E = comm.all_reduce %a {groups = #dist.groups<"{0-2}">}
