// RUN: hspmd-opt %s -p specialize-groups --split-input-file | filecheck %s

// Annotated -> physical: the step function moves into one `builtin.module @groupN` per
// device group, with `hspmd.devices`; every tensor type becomes one device's local piece
// without layout; parameters and inputs keep their annotated type as `global_type`; each
// dist.reshard keeps its two layouts as `src`/`dst` (its types are local shapes now) and its
// annotated result type as `global_type` (uneven pieces' local types do not tell the global shape).

#dup = #dist.layout<"[0-3]: dup=4">
#s2 = #dist.layout<"[0-3]: split(0)=2, split(1)=2">
#sp = #dist.layout<"[0-3]: split(0)=2, partial=2">
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<8x6xf32, #dup>
    %x = graph.input "x" : tensor<8x6xf32, #s2>
    %ws = dist.reshard %w : tensor<8x6xf32, #dup> -> tensor<8x6xf32, #s2>
    %y = graph.mul %x, %ws : (tensor<8x6xf32, #s2>, tensor<8x6xf32, #s2>) -> tensor<8x6xf32, #s2>
    %r = graph.reduce_sum %y {dims = array<i64: 1>} : (tensor<8x6xf32, #s2>) -> tensor<8xf32, #sp>
    %d = dist.reshard %r : tensor<8xf32, #sp> -> tensor<8xf32, #dup>
    graph.output "r", %d : tensor<8xf32, #dup>
    func.return
  }
}

// CHECK:       builtin.module {
// CHECK-NEXT:    builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
// CHECK-NEXT:      func.func @train_step() {
// CHECK-NEXT:        %w = graph.parameter "w" {init = "zeros", global_type = tensor<8x6xf32, #dist.layout<"[0-3]: dup=4">>} : tensor<8x6xf32>
// CHECK-NEXT:        %x = graph.input "x" {global_type = tensor<8x6xf32, #dist.layout<"[0-3]: split(0)=2, split(1)=2">>} : tensor<4x3xf32>
// CHECK-NEXT:        %ws = dist.reshard %w {global_type = tensor<8x6xf32, #dist.layout<"[0-3]: split(0)=2, split(1)=2">>, src = #dist.layout<"[0-3]: dup=4">, dst = #dist.layout<"[0-3]: split(0)=2, split(1)=2">} : tensor<8x6xf32> -> tensor<4x3xf32>
// CHECK-NEXT:        %y = graph.mul %x, %ws : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
// CHECK-NEXT:        %r = graph.reduce_sum %y {dims = array<i64: 1>} : (tensor<4x3xf32>) -> tensor<4xf32>
// CHECK-NEXT:        %d = dist.reshard %r {global_type = tensor<8xf32, #dist.layout<"[0-3]: dup=4">>, src = #dist.layout<"[0-3]: split(0)=2, partial=2">, dst = #dist.layout<"[0-3]: dup=4">} : tensor<4xf32> -> tensor<8xf32>
// CHECK-NEXT:        graph.output "r", %d : tensor<8xf32>
// CHECK-NEXT:        func.return
// CHECK-NEXT:      }
// CHECK-NEXT:    }
// CHECK-NEXT:  }

// -----

// Two device groups (a heterogeneous layout: x's batch split 1:1 between the groups, then
// split again inside [0,1]): one module per group, each with its own local shapes.

#w = #dist.layout<"[0,1]: dup=2 | [2]: dup=1 ; hetero=dup">
#x = #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=1:1">
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32, #w>
    %x = graph.input "x" : tensor<8x4xf32, #x>
    %y = graph.matmul %x, %w : (tensor<8x4xf32, #x>, tensor<4x3xf32, #w>) -> tensor<8x3xf32, #x>
    func.return
  }
}

// CHECK:       builtin.module {
// CHECK-NEXT:    builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">} {
// CHECK-NEXT:      func.func @train_step() {
// CHECK-NEXT:        %w = graph.parameter "w" {{.*}} : tensor<4x3xf32>
// CHECK-NEXT:        %x = graph.input "x" {global_type = tensor<8x4xf32, #dist.layout<"[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=1:1">>} : tensor<2x4xf32>
// CHECK-NEXT:        %y = graph.matmul %x, %w : (tensor<2x4xf32>, tensor<4x3xf32>) -> tensor<2x3xf32>
// CHECK-NEXT:        func.return
// CHECK-NEXT:      }
// CHECK-NEXT:    }
// CHECK-NEXT:    builtin.module @group1 attributes {hspmd.devices = #dist.devices<"2">} {
// CHECK-NEXT:      func.func @train_step() {
// CHECK-NEXT:        %w = graph.parameter "w" {{.*}} : tensor<4x3xf32>
// CHECK-NEXT:        %x = graph.input "x" {{.*}} : tensor<4x4xf32>
// CHECK-NEXT:        %y = graph.matmul %x, %w : (tensor<4x4xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
// CHECK-NEXT:        func.return
// CHECK-NEXT:      }
// CHECK-NEXT:    }
// CHECK-NEXT:  }
