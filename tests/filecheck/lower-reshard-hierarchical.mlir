// RUN: hspmd-opt %s -p lower-reshard | filecheck %s

// Groups of equal size that hold a gradient alike ("[0,1]: tp=2 | [2,3]: tp=2", column weight):
// partial across the groups -> replicated across them is one all_reduce over the devices that
// hold the same half ([0,2] and [1,3]); to replicated everywhere, then an all_gather inside each
// group. A transition between unlike groups is one comm.exchange naming its layouts and shape.

builtin.module {
  builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
    func.func @train_step() {
      %g = graph.input "g" {global_type = tensor<4x6xf32, #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=split(0), shares=1:1">>} : tensor<2x3xf32>
      %p = graph.scale %g {factor = 1.0 : f64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
      %a = dist.reshard %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=dup">} : tensor<2x3xf32> -> tensor<2x3xf32>
      %b = dist.reshard %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: dup=2 | [2,3]: dup=2 ; hetero=dup">} : tensor<2x3xf32> -> tensor<2x6xf32>
      graph.output "a", %a : tensor<2x3xf32>
      graph.output "b", %b : tensor<2x6xf32>
      func.return
    }
  }
  builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2,3">} {
    func.func @train_step() {
      %g = graph.input "g" {global_type = tensor<4x6xf32, #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=split(0), shares=1:1">>} : tensor<2x3xf32>
      %p = graph.scale %g {factor = 1.0 : f64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
      %a = dist.reshard %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=dup">} : tensor<2x3xf32> -> tensor<2x3xf32>
      %b = dist.reshard %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: dup=2 | [2,3]: dup=2 ; hetero=dup">} : tensor<2x3xf32> -> tensor<2x6xf32>
      %c = dist.reshard %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: split(0)=2 | [2,3]: split(1)=2 ; hetero=dup">} : tensor<2x3xf32> -> tensor<2x3xf32>
      graph.output "a", %a : tensor<2x3xf32>
      graph.output "b", %b : tensor<2x6xf32>
      graph.output "c", %c : tensor<2x3xf32>
      func.return
    }
  }
}

// CHECK-LABEL: builtin.module @group0
// CHECK:         %a = comm.all_reduce %p {groups = #dist.groups<"{0,2},{1,3}">} : tensor<2x3xf32> -> tensor<2x3xf32>
// CHECK-NEXT:    [[S:%.*]] = comm.all_reduce %p {groups = #dist.groups<"{0,2},{1,3}">} : tensor<2x3xf32> -> tensor<2x3xf32>
// CHECK-NEXT:    %b = comm.all_gather [[S]] {groups = #dist.groups<"[2,2]<=[4]">, dim = 1 : i64} : tensor<2x3xf32> -> tensor<2x6xf32>
// CHECK-LABEL: builtin.module @group1
// CHECK:         %c = comm.exchange %p {src = #dist.layout<"[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial">, dst = #dist.layout<"[0,1]: split(0)=2 | [2,3]: split(1)=2 ; hetero=dup">, shape = array<i64: 2, 6>} : tensor<2x3xf32> -> tensor<2x3xf32>
